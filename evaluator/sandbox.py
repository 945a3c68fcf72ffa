"""A run-time fence around the candidate: no network, no processes, no writes to the judge's files.

The agent's static policy (agent/policy.py) refuses such code before it runs, but it reads the
source only: a name built at run time, or an engine judged directly (a hand-written or replayed
one), gets past it. This fence is the second line, inside the evaluator's process: a Python
audit hook (PEP 578) that, while a candidate is being evaluated,

- refuses every socket operation (network),
- refuses starting processes, exec, fork and sending signals (`os.kill`), except that on CUDA
  starting processes is allowed: Triton compiles with `ptxas`, `cc` and `ldconfig` through
  `subprocess` at the first launch of a kernel;
- refuses writing, creating, deleting or renaming anything under the protected paths (the
  repository with the evaluator and the agent, the folder the verdict goes to, the weights and
  the config), so a candidate cannot forge its verdict or edit its judge. The temporary folder
  and the compiler caches stay writable.

A refused operation raises PermissionError inside the candidate and is recorded; `check()`
turns a record into a WrongResult, so swallowing the exception does not help. Native code
(ctypes, a C extension) can bypass an audit hook: the static policy bans those.
"""
from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from evaluator.common import WrongResult

NETWORK_PREFIX = "socket."
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                            "os.fork", "os.forkpty", "pty.spawn", "os.startfile"})
SIGNAL_EVENTS = frozenset({"os.kill", "os.killpg"})
# Events that change a path: event -> ((index of a path argument, index of its dir_fd or None), ...)
# as the audit events table of the Python docs lists their arguments.
PATH_WRITE_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.chflags": ((0, None),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "shutil.rmtree": ((0, 1),), "shutil.move": ((0, None), (1, None)), "shutil.copyfile": ((1, None),),
}
WRITE_MODE_CHARS = frozenset("wax+")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class _Fence:
    active: bool = False
    allow_processes: bool = False
    protected: tuple[Path, ...] = ()
    writable: tuple[Path, ...] = ()   # caches and the temporary folder (see _protected)
    refused: list[str] = field(default_factory=list)


_fence = _Fence()
_hook_installed = False


def _as_path(value: object, dir_fd: object = None) -> Path | None:
    """An absolute path; a relative one is taken from `dir_fd` when it is an open directory
    (shutil.rmtree and friends work that way), else from the working directory."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        return None
    try:
        path = Path(os.fsdecode(value))
        if not path.is_absolute() and isinstance(dir_fd, int) and dir_fd >= 0:
            path = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path
        return path.resolve()
    except (OSError, ValueError, RuntimeError):
        return None


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _protected(value: object, dir_fd: object = None) -> Path | None:
    """The path, if it lies in a protected folder. The temporary folder (where the stress suite
    writes its models' weights) and the compiler caches stay writable when they lie inside a
    protected folder (a TMPDIR or a HOME in the repository), unless a protected folder lies
    inside them (a workspace in /tmp)."""
    path = _as_path(value, dir_fd)
    if path is None:
        return None
    roots = [p for p in _fence.protected if _within(path, p)]
    if not roots or any(_within(path, w) and all(_within(w, r) for r in roots) for w in _fence.writable):
        return None
    return path


def _own_folders() -> tuple[Path, ...]:
    """Where the evaluator, torch and Triton write their own files: the temporary folder and the
    compiler caches (Triton's: TRITON_CACHE_DIR, else TRITON_HOME or HOME, then .triton)."""
    folders = [Path(tempfile.gettempdir())]
    home = os.path.expanduser("~")
    if home != "~":  # no home directory known: no caches there
        folders += [Path(os.environ.get("TRITON_HOME") or home) / ".triton", Path(home) / ".cache"]
    if os.environ.get("TRITON_CACHE_DIR"):
        folders.append(Path(os.environ["TRITON_CACHE_DIR"]))
    return tuple(f.resolve() for f in folders)


def _is_write_open(args: tuple) -> bool:
    _, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(mode, str) and WRITE_MODE_CHARS & set(mode):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def _reason(event: str, args: tuple) -> str | None:
    """Why the fence refuses this event, or None."""
    if event.startswith(NETWORK_PREFIX):
        return f"network access ({event})"
    if event in SIGNAL_EVENTS:
        return f"sending a signal ({event})"
    if event in PROCESS_EVENTS and not _fence.allow_processes:
        return f"starting a process ({event} {str(args[:2])[:120]})"
    if event == "open" and args and _is_write_open(args):
        path = _protected(args[0])
        return f"writing {path}" if path else None
    for path_at, fd_at in PATH_WRITE_EVENTS.get(event, ()):
        if path_at < len(args):
            path = _protected(args[path_at], args[fd_at] if fd_at is not None and fd_at < len(args) else None)
            if path:
                return f"changing {path} ({event})"
    return None


def _audit(event: str, args: tuple) -> None:
    if not _fence.active:
        return
    why = _reason(event, args)
    if why is not None:
        _fence.refused.append(why)
        raise PermissionError(f"refused by the evaluator's sandbox: {why}")


class Sandbox:
    """`with Sandbox(protected, device): ...` fences what runs inside; one at a time per process
    (the audit hook is installed once and stays, inert, when no sandbox is active)."""

    def __init__(self, protected: Iterable[str | Path], device: str):
        self.protected = tuple(Path(p).resolve() for p in protected)
        self.allow_processes = device == "cuda"
        self._bytecode = sys.dont_write_bytecode

    def __enter__(self) -> "Sandbox":
        global _hook_installed
        if _fence.active:
            raise RuntimeError("a sandbox is already active in this process")
        if not _hook_installed:
            sys.addaudithook(_audit)
            _hook_installed = True
        # Imports during the evaluation must not try to write .pyc files next to protected sources.
        sys.dont_write_bytecode = True
        _fence.protected, _fence.allow_processes, _fence.refused = self.protected, self.allow_processes, []
        _fence.writable = _own_folders()
        _fence.active = True
        return self

    def check(self, when: str) -> None:
        """A WrongResult if anything was refused so far (even if the candidate caught the error),
        or if the fence was switched off from inside."""
        if not _fence.active:
            raise WrongResult(f"the evaluator's sandbox was switched off ({when})")
        if _fence.refused:
            raise WrongResult(f"the candidate tried {_fence.refused[0]} ({when}); "
                              f"{len(_fence.refused)} operation(s) refused in all")

    def __exit__(self, *exc) -> None:
        _fence.active = False
        sys.dont_write_bytecode = self._bytecode
