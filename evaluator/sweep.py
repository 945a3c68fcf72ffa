"""What a worker leaves behind, found and removed: its processes (by uid, by session, and the
orphans re-parented to the judge) and the files its uid wrote in the shared folders.

The jail (evaluator/isolation.py) calls these when it closes, and the agent's judge
(agent/judge.py) before it exits. Standard library only: a worker imports its jail before
anything else.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import time

# Where a uid can leave files outside its scratch: the usual world-writable folders (and such
# folders one level down); `_world_writable()` adds any other found two levels from the root.
SHARED_TEMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/var/crash")
KILL_ROUNDS = 50                  # sweeps for processes of the uid (a fork loop races the first ones)


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


def kill_new_children(before: set[int]) -> None:
    """Children of the judge that were not there when the jail was made: orphans of the worker,
    re-parented here (the judge is a child subreaper). Killed and reaped."""
    for _ in range(KILL_ROUNDS):
        orphans = children() - before
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
                    shutil.rmtree(e.path, ignore_errors=True)
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
