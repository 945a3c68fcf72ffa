"""The Triton cache shared across a run's candidates, owned by the judge (docs/reliability.md).

Compiling a candidate's kernels was about a quarter of each evaluation on an H100, and most
candidates compile the same library kernels. So the judge keeps one cache for the run, and:

* every worker starts from a *copy* of it in its own home (`seed`): it reads what earlier
  candidates compiled, and whatever it writes stays in its jail and goes with it;
* only the judge adds to the shared cache (`merge`), from the copy of a worker that ran an engine
  whose code is all the repository's (the agent asks for it: no model-written variant), after
  that worker passed: new entries only, never a replacement, regular files only (no link is
  followed), bounded in size.

A Triton cache entry is a folder named by the hash of what was compiled (source, options, Triton
version, target) holding the compiled artefacts. A worker that runs model-written code could
write a folder under the key of a kernel that a later candidate compiles, with other machine code
in it; that is why its writes never leave its jail.

A compiled kernel's entry also holds a group file (`__grp__<kernel>.json`) that lists its
artefacts by *absolute path*, and Triton takes the kernel as cached only if every path listed
exists (`FileCacheManager.get_group`, Triton 2.1 to 3.7). Copied to another folder as it is, an
entry still names the folder it was compiled in: the jail of a worker long gone. So every copy
here, into the shared cache and out of it, points the group files at the entry's new folder
(`_relocate_group`); without that, no worker ever read a kernel from the shared cache and every
verdict compiled its engine anew (~25 s on an H100, docs/benchmarks.md twenty-first session)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

MAX_ENTRY_BYTES = 64 * 2**20     # one compiled kernel's artefacts: far below this
MAX_CACHE_BYTES = 4 * 2**30      # the shared cache stops growing here
GROUP_PREFIX = "__grp__"         # Triton's group files: a kernel's artefacts by absolute path


def seed(shared: Path, target: Path, uid: int | None) -> None:
    """`target` (a worker's TRITON_CACHE_DIR) holding a copy of every entry of `shared` it lacks,
    owned by the worker's uid, its group files pointing into the copy. An entry's name is the hash
    of what it holds, so one already there is not copied again (a worker started ahead of its
    verdict is seeded at its start and again when taken: `Jail.refresh_cache`)."""
    target.mkdir(parents=True, exist_ok=True)
    added = []
    if shared.is_dir():
        for source in shared.iterdir():
            entry = target / source.name
            if not source.is_dir() or source.is_symlink() or entry.exists():
                continue
            shutil.copytree(source, entry, symlinks=True)
            for group in entry.glob(f"{GROUP_PREFIX}*"):
                relocated = _relocate_group(_read_regular(group, MAX_ENTRY_BYTES), entry)
                if relocated is not None:
                    group.write_bytes(relocated)
            added.append(entry)
    if uid is not None:
        for path in [target, *added, *(p for entry in added for p in entry.rglob("*"))]:
            os.chown(path, uid, uid, follow_symlinks=False)


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` if it is a regular file of at most `limit` bytes, read without following
    a link or blocking on a pipe; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


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


def merge(worker_cache: Path, shared: Path) -> int:
    """Add `worker_cache`'s entries that `shared` lacks; the number added. An entry is a folder of
    regular files (anything else in it, and the entry is skipped), written beside `shared`'s and
    renamed into place, so a reader never sees half of one."""
    shared.mkdir(parents=True, exist_ok=True)
    budget = MAX_CACHE_BYTES - _size(shared)
    added = 0
    for entry in sorted(worker_cache.iterdir()) if worker_cache.is_dir() else []:
        if (shared / entry.name).exists() or entry.is_symlink() or not entry.is_dir():
            continue
        files: dict[str, bytes] = {}
        for item in entry.iterdir():
            data = _read_regular(item, MAX_ENTRY_BYTES)
            if data is None:
                break
            files[item.name] = data
        else:
            size = sum(map(len, files.values()))
            if not files or size > min(MAX_ENTRY_BYTES, budget):
                continue
            staging = Path(tempfile.mkdtemp(dir=shared, prefix=".incoming-"))
            for name in [n for n in files if n.startswith(GROUP_PREFIX)]:
                files[name] = _relocate_group(files[name], shared / entry.name) or files[name]
            for name, data in files.items():
                (staging / name).write_bytes(data)
            os.chmod(staging, 0o755)
            try:
                os.rename(staging, shared / entry.name)
            except OSError:   # another judge added it meanwhile
                shutil.rmtree(staging, ignore_errors=True)
                continue
            budget -= size
            added += 1
    return added


def compiled(worker_cache: Path, shared: Path) -> int:
    """Entries of `worker_cache` that `shared` lacks: the kernels the worker compiled, its copy of
    `shared` having held the rest. A verdict that compiles much when an earlier one compiled the
    same engine says the shared cache is not being hit (docs/benchmarks.md, twenty-first session)."""
    known = {e.name for e in shared.iterdir()} if shared.is_dir() else set()
    return sum(1 for e in worker_cache.iterdir() if e.name not in known) if worker_cache.is_dir() else 0
