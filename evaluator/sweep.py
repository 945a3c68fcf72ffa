"""What a worker leaves behind, found and removed: its processes (by uid, by session, and the
orphans re-parented to the judge) and the files its uid wrote in the shared folders.

The jail (evaluator/isolation.py) calls these when it closes, and the agent's judge
(agent/judge.py) before it exits. Standard library only: a worker imports its jail before
anything else.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

# Where a uid can leave files outside its scratch: the usual world-writable folders (and such
# folders one level down); `_world_writable()` adds any other found two levels from the root.
SHARED_TEMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/var/crash")
T = TypeVar("T")
REMOVE_SECONDS = 600.0            # for one folder's removal (rm -r of a worker's leftovers)
KILL_ROUNDS = 50                  # sweeps for processes of the uid (a fork loop races the first ones)
# A jail's folder names the judge that made it, so a later judge can tell a live jail from one
# whose judge was SIGKILLed before it could clean up (judge-worker-<pid>-<start time>-XXXX).
JAIL_PREFIX = "judge-worker-"
_JAIL_NAME = re.compile(re.escape(JAIL_PREFIX) + r"(\d+)-(\d+)-")


def processes():
    """(pid, its /proc/<pid>/status fields) for every process that can still be read."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                yield int(entry.name), dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the
    pid, a name no later process can take over."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def jail_prefix() -> str:
    """The folder-name prefix of a jail this process makes."""
    return f"{JAIL_PREFIX}{os.getpid()}-{start_time(os.getpid())}-"


def stale_jails() -> list[Path]:
    """This user's jail folders whose judge is gone (no process with that pid and start time)."""
    out = []
    for entry in os.scandir(tempfile.gettempdir()):
        match = _JAIL_NAME.match(entry.name)
        try:
            mine = entry.stat(follow_symlinks=False).st_uid == os.geteuid() and entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if match and mine and start_time(int(match[1])) != int(match[2]):
            out.append(Path(entry.path))
    return out


def sweep_stale_jails() -> None:
    """What judges killed with SIGKILL left: their workers' processes (kill(-1) as the uid owning
    the jail's home), those uids' files in the shared folders, the folders. Only folders this user
    made are considered (a worker cannot make one), and only a home of another, unprivileged uid
    (lstat: a link cannot point the sweep at root)."""
    for folder in stale_jails():
        try:
            home = os.lstat(folder / "home")
        except OSError:
            home = None
        if home is not None and stat.S_ISDIR(home.st_mode) and home.st_uid not in (0, os.geteuid()):
            kill_uid(home.st_uid)
            remove_files_of(home.st_uid)
        remove_tree(folder)


def remove_tree(path: str | os.PathLike) -> None:
    """`path` and everything under it, links not followed, never raising: a worker's folders may be
    of any depth. Python's shutil.rmtree recurses once a level, and a worker that left a folder
    3000 levels deep in its home raised RecursionError out of its jail's cleanup (the verdict kept
    "passed") and then out of every later judge's start (sweep_stale_jails: every verdict after
    it a crash, for good; red-team helper, thirty-ninth session). `rm -r` walks with fts, to any
    depth; where there is none, rmtree, whose RecursionError leaves the rest in place."""
    rm = shutil.which("rm") or "/bin/rm"
    try:
        subprocess.run([rm, "-rf", "--one-file-system", "--", os.fspath(path)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=REMOVE_SECONDS)
    except (OSError, subprocess.SubprocessError):
        pass
    if os.path.lexists(path):
        try:
            shutil.rmtree(path, ignore_errors=True)
        except RecursionError:
            pass


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a child that takes the uid sends kill(-1), which the
    kernel delivers to all of them at once (a fork loop cannot outrun it, unlike a kill per pid
    found in /proc); repeated until /proc shows none."""
    for round_ in range(KILL_ROUNDS):
        if round_ and not live_processes_of(uid):   # the first kill(-1) goes unconditionally: a
            return                                   # pid-hopping process may be between pids now
        pid = os.fork()
        if pid == 0:   # only system calls here: the judge has threads
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.01)


def live_processes_of(uid: int) -> list[int]:
    """Pids of `uid`'s processes that are not zombies (a zombie is dead; its parent reaps it)."""
    return [pid for pid, f in processes()
            if int(f.get("Uid", "-1").split()[0]) == uid and not f.get("State", "").strip().startswith("Z")]


def children() -> set[int]:
    """Pids of this process's children."""
    me = os.getpid()
    return {pid for pid, f in processes() if f.get("PPid", "").strip() == str(me)}


# The children this process started on purpose (an evaluator, a jailed worker), which
# kill_new_children of another thread must leave alone: the agent judges a candidate while its
# model episodes run unit checks in jails of their own, each of which sweeps the orphans it left.
# Without this, a unit check's sweep killed and reaped the evaluator running beside it, whose
# Popen then read "exited 0" (docs/benchmarks.md, fifteenth session). The lock spans the start
# and the registration, so no sweep sees a child in between.
_OWN: set[int] = set()
_OWN_LOCK = threading.RLock()


def start_child(start: Callable[[], T]) -> T:
    """`start()` (a Popen), its pid kept from every kill_new_children until forget_child."""
    with _OWN_LOCK:
        proc = start()
        _OWN.add(proc.pid)
    return proc


def forget_child(pid: int) -> None:
    """After the child was waited for: its pid may now be anyone's."""
    with _OWN_LOCK:
        _OWN.discard(pid)


def kill_new_children(before: set[int]) -> None:
    """Children of the judge that were not there when the jail was made, nor started on purpose
    (start_child): orphans of the worker, re-parented here (the judge is a child subreaper).
    Killed and reaped."""
    for _ in range(KILL_ROUNDS):
        with _OWN_LOCK:
            orphans = children() - before - _OWN
            if not orphans:
                return
            for pid in orphans:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass


def remove_files_of(uid: int) -> None:
    """Whatever `uid` left in the shared temporary folders (and in world-writable folders one
    level down: /tmp/.X11-unix and the like)."""
    def sweep(folder: str, depth: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    remove_tree(e.path)
                else:
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
            elif depth and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
                sweep(e.path, depth - 1)
    for folder in SHARED_TEMP + _world_writable():
        sweep(folder, 1)


def _world_writable() -> tuple[str, ...]:
    """World-writable folders within two levels of the root, beyond SHARED_TEMP (/proc and /sys
    skipped): anywhere else a uid could leave a file."""
    found = []
    for top in os.scandir("/"):
        if top.name in ("proc", "sys") or not top.is_dir(follow_symlinks=False):
            continue
        for entry in [top, *_subfolders(top.path)]:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) and mode & stat.S_IWOTH and entry.path not in SHARED_TEMP:
                found.append(entry.path)
    return tuple(found)


def _subfolders(path: str) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
