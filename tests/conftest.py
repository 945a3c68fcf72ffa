"""Shared fixtures: tiny models on disk and the rendered recompute engine.

Sizes are tiny on purpose (CI runs the whole suite on 2 CPU cores). Model fixtures are
session-scoped and read-only: a test that needs other weights writes its own with
`make_model_dir`.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from evaluator.isolation import quiet_threads

quiet_threads()   # before torch is imported, for this process and every child (see QUIET_THREADS)

import torch  # noqa: E402

from agent.plan import Plan  # noqa: E402
from agent.render import render_engine  # noqa: E402
from evaluator.common import WEIGHT_FILE  # noqa: E402
from evaluator.weights import TOY_SCALE, random_weights, save_weights  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an end-to-end run of the agent (tens of seconds); "
                                       "-m 'not slow' leaves them out")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, in their files' order otherwise: with two xdist workers the longest
    runs start at once and the short ones fill in beside them, instead of one long run starting
    last and ending alone (the suite's wall time is its longest test plus what is left)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# A small GQA model with head_dim != hidden / heads: cheap, yet not the easy case.
TINY_CONFIG = {
    "head_dim": 24,
    "hidden_size": 64,
    "intermediate_size": 160,
    "max_position_embeddings": 4096,
    "model_type": "tiny_llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
    "vocab_size": 256,
}
# For subprocesses of tiny-model tests: one intra-op thread (see `single_thread`).
SINGLE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# Weights that make attention far from uniform, so that most faults are visible.
LARGE_SCALE = 0.12
NORM_SPREAD = 0.5


@dataclass(frozen=True)
class ModelDir:
    """A model on disk as the harness sees it: a config file and a weight directory."""

    config: dict
    config_path: Path
    weight_dir: Path


def make_model_dir(root: Path, config: dict, scale: float = TOY_SCALE, norm_spread: float = 0.0,
                   seed: int = 0) -> ModelDir:
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "model_config.json"
    config_path.write_text(json.dumps(config, indent=2))
    weight_dir = root / "weights"
    save_weights(random_weights(config, seed, scale, norm_spread), weight_dir / WEIGHT_FILE)
    return ModelDir(dict(config), config_path, weight_dir)


_sources_loaded = itertools.count()


@functools.cache
def _sources_dir() -> Path:
    """One folder a test process for the sources it loads, removed when the process exits (the
    files stay while their modules may still be read: Triton and tracebacks read them)."""
    folder = tempfile.mkdtemp(prefix="loaded-sources-")
    atexit.register(shutil.rmtree, folder, True)
    return Path(folder)


def load_source(source: str, prefix: str = "module_under_test") -> ModuleType:
    """Import `source` as a fresh module: from a file of its own (Triton compiles only functions
    defined in a file), under a new name registered in sys.modules (dataclasses need it there),
    so that two loads never share module state."""
    name = f"{prefix}_{next(_sources_loaded)}"
    path = _sources_dir() / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    return dict(TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> ModelDir:
    """TINY_CONFIG with toy weights (randn * 0.02, unit norms), as the official run uses."""
    return make_model_dir(tmp_path_factory.mktemp("tiny_toy"), TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_model_large(tmp_path_factory) -> ModelDir:
    """TINY_CONFIG with larger weights and non-unit norms."""
    return make_model_dir(tmp_path_factory.mktemp("tiny_large"), TINY_CONFIG, LARGE_SCALE, NORM_SPREAD, seed=1)


@pytest.fixture(scope="session")
def recompute_source() -> str:
    return render_engine(Plan("recompute"))


@pytest.fixture(scope="session")
def recompute_engine_path(tmp_path_factory, recompute_source) -> Path:
    path = tmp_path_factory.mktemp("engines") / "recompute_engine.py"
    path.write_text(recompute_source)
    return path


@pytest.fixture
def write_engine(tmp_path):
    """write_engine(source, name) -> path of a fresh engine file in this test's tmp dir."""
    def write(source: str, name: str = "engine") -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        return path
    return write


@pytest.fixture(scope="session")
def test_seed() -> int:
    """A fresh seed per session (set EVAL_TEST_SEED to reproduce one); printed on failure."""
    seed = int(os.environ.get("EVAL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"EVAL_TEST_SEED={seed}")
    return seed


@pytest.fixture
def single_thread():
    """One intra-op thread while the test runs: tiny-model tests are all per-op overhead, and
    a second spinning thread only slows them down on a busy or 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
