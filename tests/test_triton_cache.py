"""The judge's shared Triton cache (evaluator/triton_cache.py): workers read a copy, the judge adds
only new entries made of regular files, and only for engines of the repository's own code."""
from __future__ import annotations

import os
from pathlib import Path

from agent.judge import JudgeSettings
from agent.workspace import VARIANTS
from evaluator import triton_cache


def entry(root: Path, key: str, files: dict[str, bytes]) -> Path:
    folder = root / key
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_worker_starts_from_a_copy_of_the_shared_cache(tmp_path):
    shared, worker = tmp_path / "shared", tmp_path / "home" / ".triton"
    entry(shared, "k1", {"kernel.cubin": os.urandom(64)})
    triton_cache.seed(shared, worker, uid=None)
    assert (worker / "k1" / "kernel.cubin").read_bytes() == (shared / "k1" / "kernel.cubin").read_bytes()
    (worker / "k1" / "kernel.cubin").write_bytes(b"changed in the jail")
    assert (shared / "k1" / "kernel.cubin").read_bytes() != b"changed in the jail"


def test_merge_adds_new_entries_only_and_never_follows_links(tmp_path):
    shared, worker = tmp_path / "shared", tmp_path / "worker"
    original = os.urandom(32)
    entry(shared, "known", {"kernel.cubin": original})
    entry(worker, "known", {"kernel.cubin": b"another binary under a known key"})
    fresh = os.urandom(48)
    entry(worker, "fresh", {"kernel.cubin": fresh, "kernel.json": b"{}"})
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"judge-only")
    linked = entry(worker, "linked", {"kernel.json": b"{}"})
    (linked / "kernel.cubin").symlink_to(secret)
    (worker / "dir_link").symlink_to(shared / "known")
    piped = entry(worker, "piped", {})
    os.mkfifo(piped / "kernel.cubin")
    assert triton_cache.merge(worker, shared) == 1
    assert (shared / "known" / "kernel.cubin").read_bytes() == original
    assert (shared / "fresh" / "kernel.cubin").read_bytes() == fresh
    assert sorted(p.name for p in shared.iterdir()) == ["fresh", "known"]


def test_only_engines_of_our_own_code_update_the_cache(tmp_path):
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, memory_bytes=2**30,
                             triton_cache=tmp_path / "cache")
    ours = tmp_path / "001" / "engine.py"
    model_written = tmp_path / "002" / "engine.py"
    (model_written.parent / VARIANTS).mkdir(parents=True)
    cmd = settings.command()
    assert cmd[cmd.index("--triton-cache") + 1] == str(tmp_path / "cache")
    assert settings.request(ours, tmp_path / "out")["update_cache"]
    assert not settings.request(model_written, tmp_path / "out")["update_cache"]
    no_cache = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, memory_bytes=2**30)
    assert not no_cache.request(ours, tmp_path / "out")["update_cache"]
    assert "--triton-cache" not in no_cache.command()


def test_what_a_worker_compiled_is_what_the_shared_cache_lacks(tmp_path):
    """`compiled` counts the worker's entries that the shared cache does not hold: what its jail had
    to compile rather than read from its copy (the verdict's triton_compiled)."""
    shared, worker = tmp_path / "shared", tmp_path / "home" / ".triton"
    entry(shared, "k1", {"kernel.cubin": b"1"})
    entry(shared, "k2", {"kernel.cubin": b"2"})
    triton_cache.seed(shared, worker, uid=None)
    assert triton_cache.compiled(worker, shared) == 0
    entry(worker, "k3", {"kernel.cubin": b"3"})
    entry(worker, "k4", {"kernel.cubin": b"4"})
    assert triton_cache.compiled(worker, shared) == 2
    assert triton_cache.compiled(tmp_path / "absent", shared) == 0
    assert triton_cache.compiled(worker, tmp_path / "no-shared-cache") == 4
