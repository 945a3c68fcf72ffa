"""Bad model configs end in one line and exit code 2, never a traceback (issue 20, class 9).

A 5000-digit integer (Python's int() refuses past 4300 digits, from inside json), a 100000-deep
array (RecursionError), a top level that is not an object, bytes that are not UTF-8, a missing
file, a directory, a symlink loop, and sizes that parse but no model has: each must stop
`python3 -m agent` (and `bash run.sh`, which hands over to it) with one line on stderr naming
the file or the key, exit code 2, and the workspace not even created. The evaluator reads
configs by the same loader (evaluator.common.load_config, ConfigError).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from agent.spec import SpecError, load_spec
from evaluator.common import ConfigError, load_config
from tests.test_spec import REPO, TINY_CONFIG, write_model

GOOD = json.dumps(TINY_CONFIG)


def _with(key: str, literal: str) -> str:
    """The tiny config's JSON with `key` set to a raw JSON literal (a number json.dumps could not write)."""
    return GOOD.replace(f'"{key}": {json.dumps(TINY_CONFIG[key])}', f'"{key}": {literal}')


def _write(text: str | bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return write


# Problems with the file itself: the line names the file. (writer, what the line says)
FILE_PROBLEMS: dict[str, tuple[Callable[[Path], None], str]] = {
    "5000-digit integer": (_write(_with("hidden_size", "1" + "0" * 4999)), "4300 digits"),
    "100000-deep JSON": (_write("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "top level not an object": (_write("[1, 2, 3]"), "must be a JSON object, got list"),
    "not UTF-8": (_write(GOOD.encode().replace(b'"model_type"', b'"model_type\xff"')), "not UTF-8"),
    "not JSON": (_write("{ not json"), "not valid JSON"),
    "missing file": (lambda path: None, "not found"),
    "a directory": (lambda path: path.mkdir(), "is a directory"),
}
# Values that parse but no model has: the line names the key.
VALUE_PROBLEMS: dict[str, tuple[str, str]] = {
    "100-digit hidden_size": (_with("hidden_size", "1" + "0" * 99), "'hidden_size'"),
    "hidden_size past the bound": (_with("hidden_size", str(2**20 + 1)), "'hidden_size'"),
    "4000-digit vocab_size": (_with("vocab_size", "9" * 4000), "'vocab_size'"),
    "400-digit rope_theta": (_with("rope_theta", "1" + "0" * 400), "'rope_theta'"),
    "rms_norm_eps past float": (_with("rms_norm_eps", "1e400"), "'rms_norm_eps'"),
    # a null is not a key left out: the reference and the engines raise on float(None), so it had
    # passed the spec as the default and no engine could pass (unseen-configs sweep, thirty-ninth session)
    "null rms_norm_eps": (_with("rms_norm_eps", "null"), "'rms_norm_eps' must be a positive number, got None"),
    "null rope_theta": (_with("rope_theta", "null"), "'rope_theta' must be a positive number, got None"),
}
MAX_LINE = 300   # a message quotes a value briefly, whatever its size


def bad_config(tmp_path: Path, case: str) -> tuple[Path, str]:
    """(config path, expected text) for a case of either table."""
    path = tmp_path / "bad config.json"
    if case in FILE_PROBLEMS:
        write, expected = FILE_PROBLEMS[case]
        write(path)
        return path, expected
    text, expected = VALUE_PROBLEMS[case]
    path.write_text(text)
    return path, expected


def assert_one_line(text: str, *wanted: str) -> None:
    line = text.strip()
    assert line and "\n" not in line and "Traceback" not in line, text[-2000:]
    assert len(line) < MAX_LINE, line
    for w in wanted:
        assert w in line, line


@pytest.mark.parametrize("case", sorted(FILE_PROBLEMS))
def test_load_config_raises_one_line_naming_the_file(tmp_path, case):
    path, expected = bad_config(tmp_path, case)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert isinstance(err.value, ValueError)   # callers that caught ValueError still do
    assert_one_line(str(err.value), expected, str(path))


@pytest.mark.parametrize("case", sorted(VALUE_PROBLEMS))
def test_spec_refuses_sizes_no_model_has_naming_the_key(tmp_path, case):
    config, weights = write_model(tmp_path / "model")
    path, expected = bad_config(tmp_path, case)
    with pytest.raises(SpecError) as err:
        load_spec(path, weights)
    assert_one_line(str(err.value), expected)


def test_the_largest_real_sizes_pass_the_bounds(tmp_path):
    from agent.spec import spec_from_config
    big = {**TINY_CONFIG, "hidden_size": 16384, "intermediate_size": 53248, "head_dim": 128,
           "num_attention_heads": 128, "num_key_value_heads": 8, "num_hidden_layers": 126,
           "vocab_size": 262144, "max_position_embeddings": 10_485_760, "rope_theta": 500000.0}
    assert spec_from_config(big, tmp_path / "c.json", tmp_path).intermediate == 53248


def run_agent(tmp_path: Path, config: Path, *launcher: str) -> subprocess.CompletedProcess:
    _, weights = write_model(tmp_path / "model")
    command = [*launcher, "--config", str(config), "--weights", str(weights), "--device", "cpu",
               "--budget", "30", "--workspace", str(tmp_path / "ws")]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})


# Every problem is checked above at the loader and the spec; through the whole CLI (a subprocess
# with torch each, seconds apiece on CI's two cores) one of each kind.
CLI_CASES = ["5000-digit integer", "100000-deep JSON", "a directory", "hidden_size past the bound",
             "rms_norm_eps past float"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_agent_ends_with_one_line_and_exit_2(tmp_path, case):
    config, expected = bad_config(tmp_path, case)
    done = run_agent(tmp_path, config, sys.executable, "-m", "agent")
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_line(done.stderr, "error:", expected)
    if case in FILE_PROBLEMS:
        assert str(config) in done.stderr
    assert not (tmp_path / "ws").exists()   # untouched: not even created


def test_symlink_loop_is_a_bad_input(tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    done = run_agent(tmp_path, loop, sys.executable, "-m", "agent")
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_line(done.stderr, "error:", str(loop))
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("case", ["100000-deep JSON"])
def test_run_sh_ends_with_one_line_and_exit_2(tmp_path, case):
    config, expected = bad_config(tmp_path, case)
    done = run_agent(tmp_path, config, "bash", str(REPO / "run.sh"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_line(done.stderr, "error:", expected, str(config))
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("case", ["5000-digit integer", "missing file"])
def test_evaluate_ends_with_one_line_and_exit_2(tmp_path, case):
    config, expected = bad_config(tmp_path, case)
    _, weights = write_model(tmp_path / "model")
    engine = tmp_path / "engine.py"
    engine.write_text("def create_engine(*args, **kwargs):\n    raise RuntimeError\n")
    done = subprocess.run([sys.executable, "-m", "evaluator.evaluate", "--engine", str(engine),
                           "--model-config", str(config), "--weight-dir", str(weights), "--device", "cpu",
                           "--out", str(tmp_path / "result.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_line(done.stderr, expected, str(config))


@pytest.mark.parametrize("variable,value,words", [("BUDGET", "abc", "not a number"),
                                                  ("SEED", "1.5", "not a whole number")])
def test_a_bad_number_in_the_environment_is_named_by_its_variable(monkeypatch, capsys, variable, value, words):
    """`BUDGET=abc bash run.sh` said "argument --budget: invalid float value", naming a flag the
    user never typed (a new-user walkthrough); a flag given on the command line wins over it."""
    from agent import cli
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as e:
        cli.parse_args([])
    assert e.value.code == 2 and f"{variable}={value!r}: {words}" in capsys.readouterr().err
    assert cli.parse_args([f"--{variable.lower()}", "7"]) is not None


@pytest.mark.parametrize("env,argv,words", [
    ({"BUDGET": "-1"}, [], "BUDGET must be a positive, finite number"),
    ({"MAX_CANDIDATES": "0"}, [], "MAX_CANDIDATES must be at least 1"),
    ({"MAX_CANDIDATES": "5"}, ["--max-candidates", "0"], "--max-candidates must be at least 1"),
    ({}, ["--budget", "inf"], "--budget must be a positive, finite number"),
    ({"BUILTIN_WALK": "full"}, ["--builtin-walk", "bogus"], "argument --builtin-walk: invalid choice"),
])
def test_a_bad_value_is_named_by_where_it_came_from(monkeypatch, capsys, env, argv, words):
    """`BUDGET=-1` said "--budget must be ...", `--builtin-walk bogus` "BUILTIN_WALK='bogus'", and
    `--budget inf` ran with "budget infs" (a new-user walkthrough): each names what the user set."""
    from agent import cli
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("script", ["test_correctness", "stress", "benchmark_throughput"])
def test_the_self_test_scripts_name_a_missing_input_in_one_line(tmp_path, capsys, script):
    """README's re-run commands with a misspelt engine, config or weights path ended in a
    traceback (EngineRaised, ConfigError, FileNotFoundError from create_engine; a new-user walkthrough)."""
    import importlib
    main = importlib.import_module(f"evaluator.{script}").main
    engine, config, weights = tmp_path / "engine.py", tmp_path / "config.json", tmp_path / "weights"
    engine.write_text("")
    config.write_text("{}")
    weights.mkdir()
    for args, words in [((tmp_path / "none.py", config, weights), "engine file not found"),
                        ((engine, tmp_path / "none.json", weights), "model config not found"),
                        ((engine, config, tmp_path / "none"), "weights directory not found"),
                        ((engine, config, weights), "holds none of model.pt")]:
        with pytest.raises(SystemExit) as e:
            main([f"--{flag}={value}" for flag, value in zip(("engine", "model-config", "weight-dir"), args)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_ctrl_c_while_toy_weights_are_made_is_130_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    """Ctrl-C during "making toy weights" (or a large checkpoint's check) had been a
    KeyboardInterrupt traceback and exit -2 (a new-user walkthrough)."""
    from types import SimpleNamespace

    from agent import cli
    config, weights = tmp_path / "model_config.json", tmp_path / "weights"
    config.write_text("{}")
    monkeypatch.setattr(cli, "REPO_CONFIG", config)
    monkeypatch.setattr(cli, "REPO_WEIGHTS", weights)

    def interrupted(cmd, **kw):
        Path(cmd[cmd.index("--output") + 1]).write_bytes(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.ensure_toy_weights(SimpleNamespace(config=config, weights=weights))
    assert list(weights.iterdir()) == []
    monkeypatch.setattr(cli, "ensure_toy_weights", lambda cfg: interrupted(["--output", str(weights / "x")]))
    assert cli.main(["--config", str(config), "--weights", str(weights), "--workspace", str(tmp_path / "ws")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted before the run started; nothing written"]


def test_ctrl_c_while_the_agent_imports_is_130_and_one_line(tmp_path):
    """Ctrl-C in the second or so `python3 -m agent` spends importing (torch) had been a traceback."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'agent.loop':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "agent"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 130 and done.stderr.strip().splitlines() == [
        "interrupted before the run started; nothing written"], done.stderr


def test_ctrl_c_while_the_hardware_is_measured_is_130_and_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    """Between the workspace opening and the search (the hardware measured) a Ctrl-C had escaped main."""
    from agent import cli

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "hardware", interrupted)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)   # main's SIGTERM handler stays out of pytest
    code = cli.main(["--config", str(tiny_model.config_path), "--weights", str(tiny_model.weight_dir),
                     "--device", "cpu", "--workspace", str(tmp_path / "ws"), "--seed", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1 and err[0].startswith("interrupted; "), err
    assert not (tmp_path / "ws" / "engine.py").exists()
