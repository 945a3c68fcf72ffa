"""The Triton cache shared across a run's candidates, owned by the judge (docs/reliability.md).

Compiling a candidate's kernels was about a quarter of each evaluation on an H100, and most
candidates compile the same library kernels. So the judge keeps one cache for the run, and:

* every worker starts from a *copy* of it in its own home (`seed`): it reads what earlier
  candidates compiled, and whatever it writes stays in its jail and goes with it;
* only the judge adds to the shared cache (`merge`), from the copy of a worker that passed: new
  entries only, never a replacement, regular files only (no link is followed), bounded in size.

A Triton cache entry is a folder named by the hash of what was compiled (source, options, Triton
version, target) holding the compiled artefacts. A worker that runs model-written code could
write a folder under the key of a kernel that a later candidate compiles, with other machine code
in it. So the cache is in layers, by *scope*: the set of model-written variants (the caller's
digests of their texts) that the engine held. An engine whose code is all the repository's has
the empty scope: its entries go to the shared folder itself, which every worker reads. An engine
holding model-written variants S adds to the layer of S only (`.scoped/<digest of S>/`), and a
worker reads the layers whose scope is a subset of its engine's. So an entry a worker of model
code S wrote reaches only engines that hold all of S, and run S's code in their own process
anyway; before the layers, a model's lineage recompiled every kernel on every verdict (~70
kernels, ~20 s a screen on an H200, twenty-sixth session), the library's ones included.

A compiled kernel's entry also holds a group file (`__grp__<kernel>.json`) that lists its
artefacts by *absolute path*, and Triton takes the kernel as cached only if every path listed
exists (`FileCacheManager.get_group`, Triton 2.1 to 3.7). Copied to another folder as it is, an
entry still names the folder it was compiled in: the jail of a worker long gone. So every copy
here, into the shared cache and out of it, points the group files at the entry's new folder
(`_relocate_group`); without that, no worker ever read a kernel from the shared cache and every
verdict compiled its engine anew (~25 s on an H100, docs/benchmarks.md twenty-first session)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

MAX_ENTRY_BYTES = 16 * 2**20     # one compiled kernel's artefacts: far below this
MAX_MERGE_BYTES = 256 * 2**20    # what one verdict adds (a final's ~230 kernels: far below this)
MAX_LAYER_BYTES = 512 * 2**20    # one scope's layer: one model lineage cannot fill the scopes' room
MAX_CACHE_BYTES = 4 * 2**30      # the shared cache, every layer, stops growing here
MAX_SCOPED_BYTES = 2 * 2**30     # ... and the scopes' layers together here: room stays for the shared one
LAUNCHER_SUFFIX = ".so"          # an entry with no group file: a kernel launcher, one shared object
GROUP_PREFIX = "__grp__"         # Triton's group files: a kernel's artefacts by absolute path
SCOPED = ".scoped"               # in the shared cache: a folder per scope of model-written variants
SCOPE_FILE = "scope.json"        # in a scope's folder: the variants' digests
Scope = tuple[str, ...]          # digests of the model-written variants an engine holds; () for none


def layer(shared: Path, scope: Scope) -> Path:
    """The folder entries of engines of `scope` go to."""
    if not scope:
        return shared
    return shared / SCOPED / hashlib.sha256("\n".join(sorted(set(scope))).encode()).hexdigest()[:32]


def visible(shared: Path, scope: Scope) -> list[Path]:
    """The layers a worker of an engine of `scope` reads: the shared folder and every scope's
    folder whose variants it all holds."""
    layers = [shared]
    for folder in sorted((shared / SCOPED).iterdir()) if (shared / SCOPED).is_dir() else []:
        try:
            theirs = json.loads((folder / SCOPE_FILE).read_text())["variants"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(theirs, list) and theirs and set(theirs) <= set(scope):
            layers.append(folder)
    return layers


def _entries(folder: Path) -> list[Path]:
    """A layer's entries: its folders, not links, not the judge's own (SCOPED, staging)."""
    if not folder.is_dir():
        return []
    return [e for e in folder.iterdir() if e.is_dir() and not e.is_symlink() and not e.name.startswith(".")]


def seed(shared: Path, target: Path, uid: int | None, scope: Scope = ()) -> None:
    """`target` (a worker's TRITON_CACHE_DIR) holding a copy of every entry it lacks of the layers
    an engine of `scope` reads, owned by the worker's uid, its group files pointing into the copy.
    An entry's name is the hash of what it holds, so one already there is not copied again (a
    worker started ahead of its verdict is seeded at its start and again, with its engine's
    scope, when taken: `Jail.refresh_cache`)."""
    target.mkdir(parents=True, exist_ok=True)
    added = []
    for folder in visible(shared, scope):
        for source in _entries(folder):
            entry = target / source.name
            if entry.exists():
                continue
            shutil.copytree(source, entry, symlinks=True)
            for group in entry.glob(f"{GROUP_PREFIX}*"):
                relocated = _relocate_group(read_regular(group, MAX_ENTRY_BYTES), entry)
                if relocated is not None:
                    group.write_bytes(relocated)
            added.append(entry)
    if uid is not None:
        for path in [target, *added, *(p for entry in added for p in entry.rglob("*"))]:
            os.chown(path, uid, uid, follow_symlinks=False)


def read_regular(path: Path | str, limit: int, dir_fd: int | None = None) -> bytes | None:
    """The bytes of `path` (a name in the folder `dir_fd`, where given) if it is a regular file of
    at most `limit` bytes with no other link to it, read without following a symbolic link or
    blocking on a pipe; else None. (A hard link could make a file only root may read look like a
    worker's own, where the kernel lets one be made. Also how the agent reads a judge's verdict
    files, agent/judge.py: a same-uid worker could plant either there.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit or info.st_nlink != 1:
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


def _open_folder(path: Path | str, dir_fd: int | None = None) -> int | None:
    """A descriptor of the folder `path` (in `dir_fd`), None if it is a link or no folder."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None


def _worker_folders(worker_cache: Path, skip: frozenset[str] | set[str] = frozenset()
                    ) -> Iterator[tuple[str, int | None]]:
    """(name, a descriptor of that folder, or None for a link or no folder) of each entry of a
    worker's cache but those in `skip`; a descriptor is closed when the next entry comes. The
    worker owns its home and everything in it: it can make its cache folder, or an entry, a link
    to a folder only root may read, and a judge (root) following it would copy that folder into
    the shared cache for later workers (a red-team helper did, twenty-ninth session). So every
    level is opened by name in the one above it, never following a link (the home itself lies
    in the judge's folder)."""
    top = _open_folder(worker_cache)
    if top is None:
        return
    try:
        for name in sorted(os.listdir(top)):
            if name.startswith(".") or name in skip:
                continue
            folder = _open_folder(name, top)
            try:
                yield name, folder
            finally:
                if folder is not None:
                    os.close(folder)
    except OSError:
        return
    finally:
        os.close(top)


def _worker_entries(worker_cache: Path, skip: set[str]) -> Iterator[tuple[str, dict[str, bytes] | None]]:
    """(entry name, its files, or None for an entry that is not a folder of regular files) of a
    worker's cache, one entry at a time, those named in `skip` (the shared layers hold them) not
    opened (_worker_folders)."""
    for name, folder in _worker_folders(worker_cache, skip):
        try:
            files = {item: read_regular(item, MAX_ENTRY_BYTES, folder) for item in os.listdir(folder)} \
                if folder is not None else {}
        except OSError:
            files = {}
        yield name, (files if files and all(data is not None for data in files.values()) else None)


def _worker_entry_names(worker_cache: Path) -> list[str]:
    """The names of the non-empty folders in a worker's cache (Triton makes a key's folder before
    it compiles: a failed compile leaves it empty), their files not read."""
    def non_empty(folder: int) -> bool:
        try:
            return bool(os.listdir(folder))
        except OSError:
            return False
    return [name for name, folder in _worker_folders(worker_cache) if folder is not None and non_empty(folder)]


def _relocate_group(data: bytes | None, folder: Path) -> bytes | None:
    """A Triton group file's text with every artefact's path pointed into `folder` (same file
    name; the artefacts of a kernel lie in its entry's folder); None if `data` is not one."""
    try:
        group = json.loads(data or b"")
        paths = group["child_paths"]
        moved = {str(name): str(folder / Path(str(path)).name) for name, path in paths.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return json.dumps({**group, "child_paths": moved}).encode()


def _size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*"))


def triton_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files of a worker's cache entry that Triton itself would read, {} if it is no Triton
    entry: a compiled kernel's group file and the artefacts it names (each present), or a kernel
    launcher's shared object (an entry of one file, no group). A passing engine wrote 180 MB of
    random bytes into its cache as three entries, and the judge merged them for later workers
    (red-team helper, thirty-third session); this keeps to what Triton lays out."""
    groups = [name for name in files if name.startswith(GROUP_PREFIX)]
    if not groups:
        return files if len(files) == 1 and next(iter(files)).endswith(LAUNCHER_SUFFIX) else {}
    if len(groups) != 1:
        return {}
    try:
        children = json.loads(files[groups[0]])["child_paths"]
    except (ValueError, TypeError, KeyError):
        return {}
    if not isinstance(children, dict) or not children or not set(children) <= files.keys():
        return {}
    return {name: files[name] for name in (*groups, *children)}


def merge(worker_cache: Path, shared: Path, scope: Scope = ()) -> int:
    """Add `worker_cache`'s entries that no layer of `scope` holds to `scope`'s layer; the number
    added. An entry is a folder of regular files (anything else in it, and the entry is skipped)
    laid out as Triton lays one out (`triton_files`: only those files are kept), written beside
    the layer's and renamed into place, so a reader never sees half of one. What one merge adds,
    one scope's layer, the scopes' layers together and the whole cache are bounded in bytes."""
    shared.mkdir(parents=True, exist_ok=True)
    target = layer(shared, scope)
    if scope and not (target / SCOPE_FILE).is_file():
        target.mkdir(parents=True, exist_ok=True)
        staging = target / f".{SCOPE_FILE}.incoming"
        staging.write_text(json.dumps({"variants": sorted(set(scope))}))
        os.replace(staging, target / SCOPE_FILE)
    known = {e.name for folder in visible(shared, scope) for e in _entries(folder)}
    budget = min(MAX_MERGE_BYTES, MAX_CACHE_BYTES - _size(shared))
    if scope:
        budget = min(budget, MAX_SCOPED_BYTES - _size(shared / SCOPED), MAX_LAYER_BYTES - _size(target))
    added = 0
    for key, files in _worker_entries(worker_cache, known):
        files = triton_files(files or {})
        if not files:
            continue
        size = sum(map(len, files.values()))
        if size > min(MAX_ENTRY_BYTES, budget):
            continue
        staging = Path(tempfile.mkdtemp(dir=target, prefix=".incoming-"))
        for name in [n for n in files if n.startswith(GROUP_PREFIX)]:
            files[name] = _relocate_group(files[name], target / key) or files[name]
        for name, data in files.items():
            (staging / name).write_bytes(data)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target / key)
        except OSError:   # another judge added it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
            continue
        budget -= size
        added += 1
    return added


def compiled(worker_cache: Path, shared: Path, scope: Scope = ()) -> int:
    """Entries of `worker_cache` that no layer of `scope` holds: the kernels the worker compiled,
    its copy of those layers having held the rest. A verdict that compiles much when an earlier
    one compiled the same engine says the shared cache is not being hit (docs/benchmarks.md,
    twenty-first session)."""
    known = {e.name for folder in visible(shared, scope) for e in _entries(folder)}
    return sum(1 for name in _worker_entry_names(worker_cache) if name not in known)
