"""What to serve: the engine file, the model config and weights, the tokenizer; and loading them.

Without flags the server serves `workspace/engine.py` for the model that run wrote it for:
the agent records its config and weights paths (absolute) under "run" in
`workspace/results.json`. `--weights DIR` names another model: its config is `--config`, else
the first of DIR/config.json (a Hugging Face folder), DIR/model_config.json and
DIR/../model_config.json (the course layout: model_config.json beside weights/). The tokenizer
comes from the first of the weights folder and the config's folder that holds tokenizer.json
(a Hugging Face folder), else it is the byte tokenizer.

The engine is imported in the server process and driven only through its public API: it is
an engine that passed the judge, and the user chose to serve it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.tokenizer import Tokenizer, load_tokenizer

DEFAULT_ENGINE = Path(__file__).resolve().parents[1] / "workspace" / "engine.py"   # the agent's default workspace
WORKSPACE_ENV = "AGENT_WORKSPACE"   # run.sh's workspace variable (agent/cli.py): its engine.py is the default
RESULTS_JSON = "results.json"   # beside the engine: the run's record (agent/workspace.py)
PREVIOUS = "previous"           # beside the engine: the last run, moved aside by a new one (agent/workspace.py)
ENGINE_METHODS = ("prefill", "decode", "remove")   # the runtime contract (SPEC.md §2)
CONFIG_NAMES = ("config.json", "model_config.json")   # in the weights folder, in this order
COURSE_CONFIG = "model_config.json"
DEFAULT_MAX_CONTEXT = 4096      # a config without max_position_embeddings (the engines' own default)


class ModelError(Exception):
    """Inputs that cannot be served (one line; the CLI exits 2)."""


@dataclass(frozen=True)
class ModelSource:
    engine: Path
    config: Path
    weights: Path

    @property
    def name(self) -> str:
        """The model's name in /v1/models: the weights folder's, or its parent's for `weights/`."""
        folder = self.weights if self.weights.name != "weights" else self.weights.parent
        return folder.name or "model"


def default_engine() -> Path:
    """The engine a run wrote: in $AGENT_WORKSPACE where set (the caller's folder is the current
    one: agent/caller.py), else in the repository's workspace/."""
    workspace = os.environ.get(WORKSPACE_ENV)
    return Path(workspace) / "engine.py" if workspace else DEFAULT_ENGINE


def resolve_source(engine: Path | None, weights: Path | None, config: Path | None) -> ModelSource:
    engine = (engine or default_engine()).resolve()
    if engine.is_dir() and (engine / "engine.py").is_file():   # the workspace named instead of its engine
        raise ModelError(f"--engine {engine} is a folder; its engine is --engine {engine / 'engine.py'}")
    if not engine.is_file():
        last = engine.parent / PREVIOUS / engine.name   # a new run moved the last one aside (agent/workspace.py)
        raise ModelError(f"no engine at {engine}: run `bash run.sh` first, or pass --engine"
                         + (f" (the last run's: --engine {last})" if last.is_file() else ""))
    if weights is None:
        if config is not None:
            raise ModelError("--config needs --weights")
        weights, config = _recorded_inputs(engine)
    weights = weights.resolve()
    if not weights.is_dir():   # a file had been reported as missing
        raise ModelError(f"weights folder {weights} "
                         + ("is a file: give the folder that holds it" if weights.exists() else "does not exist"))
    config = config.resolve() if config else _find_config(weights)
    if not config.is_file():
        raise ModelError(f"model config {config} does not exist")
    return ModelSource(engine, config, weights)


def _recorded_inputs(engine: Path) -> tuple[Path, Path]:
    """(weights, config) of the run that wrote `engine`, from results.json beside it."""
    record = engine.parent / RESULTS_JSON
    try:
        run = json.loads(record.read_text(encoding="utf-8"))["run"]
        return Path(run["weights"]), Path(run["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{record} does not say which model {engine.name} was written for ({e}); "
                         "pass --weights DIR [--config CFG]") from None


def _find_config(weights: Path) -> Path:
    for path in [weights / n for n in CONFIG_NAMES] + [weights.parent / COURSE_CONFIG]:
        if path.is_file():
            return path
    raise ModelError(f"no config.json or model_config.json in {weights} or beside it; pass --config")


@dataclass
class LoadedModel:
    """An engine instance and everything the server needs around it."""

    source: ModelSource
    config: dict
    engine: Any
    tokenizer: Tokenizer
    device: str
    max_context: int
    vocab_size: int


def load_model(source: ModelSource, device: str, max_context: int | None = None) -> LoadedModel:
    from evaluator.common import ConfigError, load_config, load_engine_module, resolve_device  # torch

    try:
        config = load_config(source.config)
    except ConfigError as e:
        raise ModelError(str(e)) from None
    device = resolve_device(device)
    tokenizer = load_tokenizer([source.weights, source.config.parent])
    engine = load_engine_module(source.engine).create_engine(config, str(source.weights), device)
    missing = [name for name in ENGINE_METHODS if not callable(getattr(engine, name, None))]
    if missing:
        raise ModelError(f"{source.engine}: create_engine returned a {type(engine).__name__} without "
                         f"{', '.join(missing)} (SPEC.md §2)")
    limit = int(config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
    return LoadedModel(source, config, engine, tokenizer, device, min(max_context or limit, limit),
                       int(config["vocab_size"]))
