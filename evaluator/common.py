"""Helpers every evaluator script shares: configs, devices, dtypes, engine loading, errors.

The official harness resolves devices, dtypes and configs in one way (SPEC.md §1-§3); every
script here must agree with it, so each of those rules is written once, in this file.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from evaluator.checkpoint import (COURSE_EPS, SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, is_hf, load_hf_weights,
                                 not_a_folder, rope_theta, stored_dtype_name, with_config_defaults)

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHT_FILE = "model.pt"
BF16_NAMES = ("bfloat16", "bf16")

# error_kind values of docs/design.md §2 (timeout is recorded by the judge, never here).
COMPILE_ERROR = "compile_error"
RUNTIME_ERROR = "runtime_error"
WRONG_RESULT = "wrong_result"
CRASH = "crash"


class EvalFailure(Exception):
    """A verdict against the candidate; `kind` is its error_kind."""

    kind = CRASH


class EngineRaised(EvalFailure):
    """The candidate's own code raised (at import, in create_engine, or in a call)."""

    def __init__(self, message: str, kind: str = RUNTIME_ERROR):
        super().__init__(message)
        self.kind = kind


class WrongResult(EvalFailure, AssertionError):
    """An output that is invalid or disagrees with the reference (an AssertionError, as the
    official correctness script raises on a mismatch)."""

    kind = WRONG_RESULT


@dataclass(frozen=True)
class Tolerance:
    """What a logit row is compared with, and how closely. reference_dtype None: the compute
    dtype (SPEC.md §3, the course judge); torch.float32 under the bf16 criterion for Hugging
    Face models in half precision (evaluator/hf_judge.py), with atol measured on the model."""

    atol: float = 1e-2
    rtol: float = 1e-2
    reference_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a model config, with SPEC.md §1 defaults applied."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    theta: float
    dtype_name: str

    @staticmethod
    def from_config(config: dict) -> "ModelDims":
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return ModelDims(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),   # null: as absent (transformers)
            vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", COURSE_EPS)),
            theta=rope_theta(config),
            dtype_name=stored_dtype_name(config),
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer's matrices (norm vectors are negligible)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token leaves in the cache, over all layers."""
        return 2 * self.kv_heads * self.head_dim * self.layers


class ConfigError(ValueError):
    """A model config file that cannot be used, said in one line that names the file."""


MAX_CONFIG_BYTES = 1 << 20   # a model config is a few KiB; a file past this is not one


def load_config(config: dict | str | Path) -> dict:
    """A config dict, from a dict or a JSON file. Every way the file can be unusable (missing, a
    directory, unreadable, too large, not UTF-8, not JSON, an integer past Python's 4300-digit
    limit, nested past the recursion limit, not an object) raises ConfigError with one line, so
    that an entry point can end with that line and exit code 2 rather than a traceback. An HF
    config comes with its architecture's defaults for the keys it leaves out (with_config_defaults)."""
    if isinstance(config, dict):
        return with_config_defaults(config)
    path = Path(config)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"model config not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"model config {path} is a directory, not a JSON file") from None
    except OSError as e:
        raise ConfigError(f"model config {path} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"model config {path} is over {MAX_CONFIG_BYTES} bytes; a model config is a few KiB")
    try:
        parsed = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"model config {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
                          ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"model config {path} is nested too deeply to be a model config") from None
    except ValueError as e:  # an integer literal past the 4300-digit limit of int()
        raise ConfigError(f"model config {path} cannot be parsed: {str(e).split(';')[0]}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"model config {path} must be a JSON object, got {type(parsed).__name__}")
    return with_config_defaults(parsed)


def resolve_device(device: str) -> str:
    """`auto`, and `cuda` without a GPU, resolve as the harness does: cuda if available else cpu."""
    if device in ("auto", "cuda") or device.startswith("cuda:"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def compute_dtype(config: dict, device: str) -> torch.dtype:
    """SPEC.md §3: fp32 on CPU; on CUDA bf16 if `torch_dtype` names it, else fp16."""
    if resolve_device(device) != "cuda":
        return torch.float32
    name = stored_dtype_name(config).lower()
    return torch.bfloat16 if name in BF16_NAMES else torch.float16


def load_weights(weight_dir: str | Path, config: dict | None = None) -> dict[str, torch.Tensor]:
    """The state dict under bare names: model.pt for the course format (config None or a course
    config), the HF folder's files (evaluator/checkpoint.py) for a config naming its architecture."""
    if config is not None and is_hf(config):
        return load_hf_weights(weight_dir, config)
    path = Path(weight_dir) / WEIGHT_FILE
    return load_course_file(path, mapped=_mappable(path))


def load_course_file(path: Path, mapped: bool = True) -> dict:
    """A course-format model.pt: mapped where `mapped` (each tensor read when it is cast), read
    whole otherwise or where it cannot be mapped (a legacy, non-zip file)."""
    if mapped:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
    return torch.load(path, map_location="cpu", weights_only=True)


def _mappable(path: Path) -> bool:
    """Whether the judge may map the weights rather than read them: a mapping sees later writes
    to the file (a CPU fp32 reference keeps reading it), so only where no worker can write it:
    the judge is root (a confined worker runs as a uid of its own), the file is root's, and
    no one else may write it."""
    try:
        st = path.stat()
    except OSError:
        return False   # torch.load says what is wrong with it
    return os.geteuid() == 0 and st.st_uid == 0 and not st.st_mode & 0o022


def freeze_imports() -> None:
    """Every object made so far (the imports': ~170K, torch's mostly) moved out of the garbage
    collector's view, for a process that collects often: a full collection walked them all, ~85
    ms each, and a screen collects 16 times in the judge (release_device_memory, each timed
    trace) and once per engine released in the worker: ~1.3 s of a 12 s screen in the judge
    alone (an H200, thirty-first session, `python3 -m scripts.gpu verdict-split`). What is made
    later is collected as before. No collection first (~0.16 s a process start, and the suite
    starts hundreds of workers): what the imports left as garbage stays, frozen."""
    gc.freeze()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def draw_tokens(gen: torch.Generator, length: int, vocab: int, device: str) -> torch.Tensor:
    """`length` random token ids, int64, drawn on `device` (as the harness draws them)."""
    return torch.randint(0, vocab, (length,), generator=gen, device=device, dtype=torch.long)


def make_generator(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


_loaded = 0


def load_engine_module(engine: ModuleType | str | Path) -> ModuleType:
    """The candidate module, from a module (or a stand-in for one, such as the judge's
    evaluator.remote.RemoteModule) or a file path; it must define `create_engine`.

    Each load gets a fresh module name (registered in sys.modules, which dataclasses and
    triton's source lookup need), so two candidates never share module state.
    """
    global _loaded
    if not isinstance(engine, (str, Path)):
        module = engine
    else:
        path = Path(engine).resolve()
        if not path.is_file():
            raise EngineRaised(f"engine file not found: {path}", COMPILE_ERROR)
        _loaded += 1
        name = f"candidate_engine_{_loaded}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - any failure to import is the candidate's
            sys.modules.pop(name, None)
            raise EngineRaised(f"importing {path.name} failed: {_describe(e)}", COMPILE_ERROR) from e
    if not callable(getattr(module, "create_engine", None)):
        raise EngineRaised("the engine module defines no callable create_engine", COMPILE_ERROR)
    return module


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _kind_of(e: BaseException) -> str:
    """Triton compilation failures (raised at the first launch or in autotuning) count as
    compile errors; anything else the engine raises is a runtime error."""
    return COMPILE_ERROR if "Compil" in type(e).__name__ else RUNTIME_ERROR


def call_engine(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call into the candidate; whatever it raises becomes an EngineRaised naming the call."""
    try:
        return fn(*args)
    except EvalFailure:
        raise
    except Exception as e:  # noqa: BLE001 - the candidate may raise anything
        raise EngineRaised(f"{what} raised {_describe(e)}", _kind_of(e)) from e



def harness_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every official-style script takes, spelled as the harness does."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--engine", required=True)
    p.add_argument("--model-config", required=True)
    p.add_argument("--weight-dir", required=True)
    p.add_argument("--device", default="auto")
    return p


WEIGHT_FILES = (WEIGHT_FILE, SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN)   # a weights folder holds one


def check_harness_inputs(engine, model_config=None, weight_dir=None) -> None:
    """The self-test scripts' inputs, or one `error:` line naming the bad one and exit 2: a
    misspelt path had been a traceback (ConfigError, EngineRaised, FileNotFoundError from inside
    create_engine) that read as the engine failing (a new-user walkthrough)."""
    problem = None
    if not Path(engine).is_file():
        problem = f"engine file not found: {engine}"
    elif model_config is not None:
        try:
            load_config(model_config)
        except ConfigError as e:
            problem = str(e)
    if problem is None and weight_dir is not None:
        folder = Path(weight_dir)
        if not folder.is_dir():
            problem = not_a_folder(folder)
        elif not any((folder / name).is_file() for name in WEIGHT_FILES):
            problem = f"{weight_dir} holds none of {', '.join(WEIGHT_FILES)}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def parse_cases(text: str) -> list[str]:
    """`--cases a,b,c` as a list."""
    return [c.strip() for c in text.split(",") if c.strip()]
