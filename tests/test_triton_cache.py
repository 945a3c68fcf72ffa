"""The judge's shared Triton cache (evaluator/triton_cache.py): workers read a copy, the judge adds
only new entries made of regular files, and only for engines of the repository's own code."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agent.judge import JudgeSettings
from agent.workspace import VARIANTS
from evaluator import triton_cache


def entry(root: Path, key: str, files: dict[str, bytes], group: bool = True) -> Path:
    """A cache entry holding `files`; with `group` (and files, none of them a group file) laid
    out as Triton lays out a compiled kernel: a group file naming each of them by its path."""
    folder = root / key
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if group and files and not any(n.startswith(triton_cache.GROUP_PREFIX) for n in files):
        kernel = Path(next(iter(files))).stem
        (folder / f"{triton_cache.GROUP_PREFIX}{kernel}.json").write_text(
            json.dumps({"child_paths": {n: str(folder / n) for n in files}}))
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


def test_a_worker_cache_that_is_a_link_or_holds_hard_links_adds_nothing(tmp_path):
    """The worker owns its home: its cache folder made a link to a folder only root may read (whose
    subfolders look like entries), or a file hard-linked to one it may not read. Merged as root,
    either would have copied root's files into the cache later workers get (red-team helper,
    twenty-ninth session). Nothing is followed at any level, and a file with two links is refused."""
    shared, home = tmp_path / "shared", tmp_path / "home"
    private = tmp_path / "private"
    entry(private, "stolen", {"key.txt": b"root only"})
    home.mkdir()
    (home / ".triton").symlink_to(private)
    assert triton_cache.merge(home / ".triton", shared) == 0
    assert triton_cache.compiled(home / ".triton", shared) == 0
    (home / ".triton").unlink()
    linked = entry(home / ".triton", "linked", {"kernel.json": b"{}"})
    os.link(private / "stolen" / "key.txt", linked / "kernel.cubin")
    fresh = entry(home / ".triton", "fresh", {"kernel.cubin": b"compiled here"})
    assert triton_cache.merge(home / ".triton", shared) == 1
    assert sorted(p.name for p in shared.iterdir()) == [fresh.name]


def test_every_passing_engine_adds_to_the_layer_of_its_model_written_code(tmp_path):
    """The request names the engine's scope: the digests of the model-written variants its
    candidate folder holds (none for the repository's own code), each text with its name."""
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, memory_bytes=2**30,
                             triton_cache=tmp_path / "cache")
    ours = tmp_path / "001" / "engine.py"
    model_written = tmp_path / "002" / "engine.py"
    (model_written.parent / VARIANTS).mkdir(parents=True)
    (model_written.parent / VARIANTS / "norm.llm_1.py.j2").write_text("def rmsnorm__llm_1(): pass\n")
    (model_written.parent / VARIANTS / "linear.llm_2.py.j2").write_text("def linear__llm_2(): pass\n")
    renamed = tmp_path / "003" / "engine.py"
    (renamed.parent / VARIANTS).mkdir(parents=True)
    (renamed.parent / VARIANTS / "norm.llm_3.py.j2").write_text("def rmsnorm__llm_1(): pass\n")
    cmd = settings.command()
    assert cmd[cmd.index("--triton-cache") + 1] == str(tmp_path / "cache")
    assert settings.request(ours, tmp_path / "out")["update_cache"]
    assert settings.request(ours, tmp_path / "out")["cache_scope"] == []
    scope = settings.request(model_written, tmp_path / "out")["cache_scope"]
    assert settings.request(model_written, tmp_path / "out")["update_cache"] and len(set(scope)) == 2
    assert not set(settings.request(renamed, tmp_path / "out")["cache_scope"]) & set(scope)   # same text, another name
    no_cache = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, memory_bytes=2**30)
    assert not no_cache.request(ours, tmp_path / "out")["update_cache"]
    assert "--triton-cache" not in no_cache.command()


def test_what_model_code_compiled_reaches_only_engines_that_hold_that_code(tmp_path):
    """A worker reads the shared layer and the layers of scopes within its engine's; what a worker
    of model code A compiled goes to A's layer: an engine of A and B reads it, an engine of B
    alone, or of the repository's code alone, never does."""
    shared = tmp_path / "shared"
    entry(shared, "library", {"kernel.cubin": b"lib"})
    worker_a = tmp_path / "a"
    triton_cache.seed(shared, worker_a, uid=None, scope=("aa",))
    entry(worker_a, "poisoned_or_not", {"kernel.cubin": b"from model code A"})
    assert triton_cache.compiled(worker_a, shared, ("aa",)) == 1
    assert triton_cache.merge(worker_a, shared, ("aa",)) == 1
    assert sorted(p.name for p in triton_cache._entries(shared)) == ["library"]   # the shared layer: untouched
    assert triton_cache.merge(worker_a, shared, ("aa",)) == 0                     # known now: not added twice

    def reads(scope) -> list[str]:
        worker = tmp_path / f"w-{'-'.join(scope) or 'ours'}"
        triton_cache.seed(shared, worker, uid=None, scope=scope)
        return sorted(p.name for p in worker.iterdir())
    assert reads(()) == ["library"] and reads(("bb",)) == ["library"]
    assert reads(("aa", "bb")) == ["library", "poisoned_or_not"] and reads(("aa",)) == ["library", "poisoned_or_not"]
    # an engine of A and B adds what it compiled to A+B's layer, which A alone does not read
    worker_ab = tmp_path / "w-aa-bb"
    entry(worker_ab, "ab_only", {"kernel.cubin": b"from A and B"})
    assert triton_cache.merge(worker_ab, shared, ("bb", "aa")) == 1
    assert "ab_only" not in reads(("aa", "cc")) and "ab_only" in reads(("aa", "bb", "cc"))
    assert triton_cache.compiled(worker_ab, shared, ("aa", "bb")) == 0
    # a scope's layer without its scope file is read by nobody
    stray = shared / triton_cache.SCOPED / "stray"
    entry(stray, "stray_entry", {"kernel.cubin": b"?"})
    assert "stray_entry" not in reads(("aa", "bb", "dd"))


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


def triton_group(folder: Path, kernel: str, written_in: Path) -> dict[str, str]:
    """A compiled kernel's entry as Triton writes it: artefacts, and a group file naming them by
    absolute path in the folder it was compiled in (`written_in`)."""
    names = [f"{kernel}.cubin", f"{kernel}.json"]
    entry(folder.parent, folder.name, {n: os.urandom(16) for n in names})
    group = {n: str(written_in / n) for n in names}
    (folder / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": group}))
    return group


def cached(folder: Path, kernel: str) -> bool:
    """Triton's test for a cached kernel (FileCacheManager.get_group, then the metadata's path):
    the group file's every path exists, the metadata's among them."""
    paths = json.loads((folder / f"__grp__{kernel}.json").read_text())["child_paths"]
    return f"{kernel}.json" in paths and all(Path(p).exists() for p in paths.values())


def test_group_files_point_into_every_copy_of_an_entry(tmp_path):
    """A worker's entry names its artefacts by absolute path in that worker's jail, which is gone
    by the time the next worker reads the shared cache: merge and seed point the paths at the
    entry's new folder, or no worker would ever find a kernel cached."""
    jail = tmp_path / "jail-1" / ".triton"
    triton_group(jail / "key1", "_gemm_kernel", written_in=jail / "key1")
    shared, worker = tmp_path / "shared", tmp_path / "jail-2" / ".triton"
    assert triton_cache.merge(jail, shared) == 1
    shutil.rmtree(tmp_path / "jail-1")                      # the first worker's jail, torn down
    assert cached(shared / "key1", "_gemm_kernel")
    triton_cache.seed(shared, worker, uid=None)
    assert cached(worker / "key1", "_gemm_kernel")
    assert all(Path(p).parent == worker / "key1" for p in json.loads(
        (worker / "key1" / "__grp___gemm_kernel.json").read_text())["child_paths"].values())


def test_only_what_triton_lays_out_is_merged(tmp_path, monkeypatch):
    """A passing engine wrote three 60 MiB folders of random bytes into its cache, and the judge
    merged them for every later worker (red-team helper, thirty-third session). Merged now: a
    compiled kernel's group file and the artefacts it names (files it does not name are left), or
    a launcher's one shared object; a verdict's merge and one scope's layer are bounded in bytes."""
    jail, shared = tmp_path / "jail" / ".triton", tmp_path / "shared"
    entry(jail, "junk", {"blob.bin": os.urandom(64)}, group=False)
    entry(jail, "two_objects", {"a.so": b"1", "b.so": b"2"}, group=False)
    entry(jail, "not_json", {"__grp__k.json": b"not json", "k.cubin": b"1"})
    entry(jail, "not_a_group", {"__grp__k.json": b'{"child_paths": 3}', "k.cubin": b"2"})
    entry(jail, "names_a_missing_file", {"__grp__k.json": json.dumps({"child_paths": {"k.cubin": "/x/k.cubin",
                                                                                      "k.json": "/x/k.json"}}).encode(),
                                         "k.cubin": b"3"})
    entry(jail, "two_groups", {"__grp__a.json": b'{"child_paths": {}}', "__grp__b.json": b'{"child_paths": {}}'})
    launcher = entry(jail, "launcher", {"__triton_launcher.cpython-312-x86_64-linux-gnu.so": b"elf"}, group=False)
    kernel = entry(jail, "kernel", {"k.cubin": b"4", "k.json": b"{}"})
    (kernel / "padding.bin").write_bytes(os.urandom(1024))   # not named by its group: left out
    assert triton_cache.merge(jail, shared) == 2
    assert sorted(p.name for p in shared.iterdir()) == ["kernel", "launcher"]
    assert sorted(p.name for p in (shared / "kernel").iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]
    assert [p.name for p in (shared / "launcher").iterdir()] == [next(launcher.iterdir()).name]

    monkeypatch.setattr(triton_cache, "MAX_MERGE_BYTES", 3000)
    big = tmp_path / "big" / ".triton"
    for i in range(5):
        entry(big, f"big{i}", {"k.cubin": os.urandom(1000)})
    assert triton_cache.merge(big, shared) == 2           # a verdict's bytes
    monkeypatch.setattr(triton_cache, "MAX_MERGE_BYTES", 10**6)
    monkeypatch.setattr(triton_cache, "MAX_LAYER_BYTES", 5000)
    lineage = tmp_path / "lineage" / ".triton"
    for i in range(8):
        entry(lineage, f"model{i}", {"k.cubin": os.urandom(1000)})
    assert triton_cache.merge(lineage, shared, ("aa",)) == 4      # one scope's layer
    assert triton_cache.merge(lineage, shared, ("bb",)) == 4      # another scope has its own room


def test_tritons_own_cache_manager_finds_a_kernel_in_a_seeded_copy(tmp_path, monkeypatch):
    """The same with Triton's FileCacheManager itself (where Triton is installed): written in one
    jail, merged, the jail removed, seeded into another, and found there."""
    runtime_cache = pytest.importorskip("triton.runtime.cache")
    jail, shared, worker = tmp_path / "jail-1", tmp_path / "shared", tmp_path / "jail-2"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(jail))
    manager = runtime_cache.FileCacheManager("key1")
    group = {name: manager.put(os.urandom(16), name, binary=True) for name in ("k.cubin", "k.json")}
    manager.put_group("k.json", group)
    assert set(manager.get_group("k.json")) == {"k.cubin", "k.json"}
    triton_cache.merge(jail, shared)
    shutil.rmtree(jail)
    triton_cache.seed(shared, worker, uid=None)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(worker))
    found = runtime_cache.FileCacheManager("key1").get_group("k.json")
    assert set(found) == {"k.cubin", "k.json"} and all(Path(p).parent == worker / "key1" for p in found.values())


def test_a_worker_started_ahead_gets_the_kernels_added_since(tmp_path):
    """The resident judge starts the next verdict's worker while this one runs (its spare); the
    kernels this verdict then adds to the shared cache are copied into the spare's jail when it is
    taken (Jail.refresh_cache), group files pointing into its copy."""
    from evaluator import isolation
    shared = tmp_path / "shared"
    entry(shared, "early", {"kernel.cubin": os.urandom(16)})
    jail = isolation.Jail("cpu", triton_cache=shared)
    try:
        assert sorted(p.name for p in jail.compile_cache.iterdir()) == ["early"]
        late = entry(shared, "late", {"kernel.cubin": os.urandom(16)})
        (late / f"{triton_cache.GROUP_PREFIX}kernel.json").write_text(
            json.dumps({"child_paths": {"kernel.cubin": str(late / "kernel.cubin")}}))
        jail.refresh_cache()
        assert sorted(p.name for p in jail.compile_cache.iterdir()) == ["early", "late"]
        group = json.loads((jail.compile_cache / "late" / f"{triton_cache.GROUP_PREFIX}kernel.json").read_text())
        assert group["child_paths"]["kernel.cubin"] == str(jail.compile_cache / "late" / "kernel.cubin")
        scoped = tmp_path / "scoped-worker"
        entry(scoped, "model_kernel", {"kernel.cubin": os.urandom(16)})
        triton_cache.merge(scoped, shared, ("ab12",))
        jail.refresh_cache()
        assert "model_kernel" not in {p.name for p in jail.compile_cache.iterdir()}
        jail.refresh_cache(("ab12",))   # taken for an engine of that model code: its layer too
        assert sorted(p.name for p in jail.compile_cache.iterdir()) == ["early", "late", "model_kernel"]
    finally:
        jail.close()


def test_merge_and_compiled_read_only_the_entries_the_shared_cache_lacks(tmp_path, monkeypatch):
    """A worker's cache is a copy of the shared one plus what it compiled: the judge reads the
    new entries' files only (the shared cache may hold gigabytes), and counting them reads none."""
    shared, worker = tmp_path / "shared", tmp_path / "home" / ".triton"
    for i in range(5):
        entry(shared, f"k{i}", {"kernel.cubin": os.urandom(64)})
    triton_cache.seed(shared, worker, uid=None)
    entry(worker, "new", {"kernel.cubin": b"compiled here", "kernel.json": b"{}"})
    reads = []
    real = triton_cache.read_regular
    monkeypatch.setattr(triton_cache, "read_regular", lambda path, *a, **k: reads.append(str(path)) or real(path, *a, **k))
    (worker / "failed").mkdir()   # Triton makes a key's folder first: a failed compile leaves it empty
    assert triton_cache.compiled(worker, shared) == 1 and reads == []
    assert triton_cache.merge(worker, shared) == 1
    assert sorted(reads) == ["__grp__kernel.json", "kernel.cubin", "kernel.json"]
