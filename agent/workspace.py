"""The workspace: atomic writes, one folder per candidate, and a git history of accepted engines.

`engine.py` changes only through `install_engine`, which writes a temporary file in the same
folder, fsyncs it and renames it over the old one: a kill at any moment leaves the previous
passing engine or the new passing engine, never half of one. `engine.json` beside it records
the verdict and the sha256 of the engine it describes, so the exit code can be decided from
the files alone.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

ENGINE = "engine.py"
VERDICT = "engine.json"
RESULTS_LOG = "results.log"
RESULTS_JSON = "results.json"
CANDIDATES = "candidates"
JUDGE_LOGS = f"{CANDIDATES}/judge"   # the run's judge's own stdout/stderr (its verdicts' lie beside each)
VARIANTS = "variants"   # in a candidate's folder: the sources of its model-written kernel variants
WAITING = "waiting.json"   # model candidates checked but not judged yet (agent/pipeline.py), for --resume
TMP_PREFIX = ".tmp-"
PREVIOUS = "previous"   # the last run's engine, verdict, logs and candidates, moved aside by a new run
PREVIOUS_INCOMING = ".previous-incoming"   # ... while they are being moved (a kill leaves it to finish)
PREVIOUS_OLD = ".previous-old"             # ... the run before that, while it is removed
AHEAD = "ahead"         # candidates screened ahead on a spare GPU (agent/screens.py), not reached by the run
# What a run leaves in the workspace, moved aside as a whole when a new run starts (Workspace.reset)
RUN_FILES = (ENGINE, VERDICT, RESULTS_LOG, RESULTS_JSON, WAITING, "search.png", CANDIDATES, AHEAD)
LOCK = ".lock"          # held (flock) by the run using the workspace
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)   # flock's answers where a filesystem has none
GIT_IGNORE = f"{CANDIDATES}/\n{AHEAD}/\n{TMP_PREFIX}*\n{PREVIOUS}/\n{PREVIOUS_INCOMING}/\n{PREVIOUS_OLD}/\n{LOCK}\n"
# Temporary files a kill can leave: ours (atomic_write) and the evaluator's verdict in progress.
LEFTOVERS = (f"{TMP_PREFIX}*", f"{CANDIDATES}/**/{TMP_PREFIX}*", f"{CANDIDATES}/**/*.tmp[0-9]*")
GIT_AUTHOR = ("inference-agent", "agent@localhost")


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class WorkspaceBusy(Exception):
    """Another run holds the workspace (Workspace.locked)."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Workspace:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.repo = None
        self.warn: Callable[[str], None] = print

    @property
    def engine(self) -> Path:
        return self.root / ENGINE

    @contextlib.contextmanager
    def locked(self):
        """The workspace held by this run for as long as the block lasts: a second run on it (which
        would interleave its engines and logs with this one's) is refused with WorkspaceBusy. The
        lock goes with the process, however it ends."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip()
                raise WorkspaceBusy(f"another run is using the workspace {self.root}"
                                    + (f" (pid {holder})" if holder.isdigit() else "")
                                    + ": wait for it, stop it, or give this run another --workspace") from None
            except OSError as e:   # a filesystem without locks: the run goes on, unguarded
                if e.errno not in NO_LOCKS:
                    raise
                self.warn(f"the workspace {self.root} cannot be locked ({e.strerror}): "
                          "nothing stops a second run from using it at the same time")
                yield
                return
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def reset(self) -> str | None:
        """Start a new run: the last run's engine, verdict, logs and candidates are moved, as they
        are, to previous/ (replacing the run before it; accepted engines also stay in the git
        history), and any temporary file a kill left behind is removed. A second run had deleted
        the first run's engine before it had a better one, and a Ctrl-C then left none (a new-user
        walkthrough, thirty-third session). A run that left no engine is dropped instead, so that
        two runs stopped early in a row do not push out the last engine. The moves are renames,
        resumed by the next reset if a kill cuts them. Returns a line saying what was moved, or None."""
        self.root.mkdir(parents=True, exist_ok=True)
        incoming, previous, old = (self.root / name for name in (PREVIOUS_INCOMING, PREVIOUS, PREVIOUS_OLD))
        shutil.rmtree(old, ignore_errors=True)
        present = [name for name in RUN_FILES if (self.root / name).exists()]
        if incoming.exists() or self.engine.exists():
            incoming.mkdir(exist_ok=True)
            for name in present:
                os.replace(self.root / name, incoming / name)
            if previous.exists():
                os.replace(previous, old)
            os.replace(incoming, previous)
            shutil.rmtree(old, ignore_errors=True)
        else:   # a run that left no engine (stopped early): previous/ keeps the last one that did
            for path in (self.root / name for name in present):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        self.clear_leftovers()
        if (previous / ENGINE).exists():
            return f"the last run's engine, log and candidates are in {previous}/"
        return None

    def clear_leftovers(self) -> None:
        """Remove the temporary files a kill left behind (never a finished file), and make sure
        the candidates folder exists."""
        self.root.mkdir(parents=True, exist_ok=True)
        for pattern in LEFTOVERS:
            for leftover in self.root.glob(pattern):
                leftover.unlink(missing_ok=True)
        (self.root / CANDIDATES).mkdir(exist_ok=True)

    def candidate_dir(self, index: int, short: str) -> Path:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", short).strip("-")[:48] or "candidate"
        path = self.root / CANDIDATES / f"{index:03d}-{slug}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def install_engine(self, source: str, verdict: dict) -> None:
        """Replace engine.py (atomically) by a candidate that passed, then record why."""
        atomic_write(self.engine, source)
        atomic_write(self.root / VERDICT, json.dumps({**verdict, "sha256": sha256(source)}, indent=2) + "\n")

    def save_waiting(self, records: list[dict]) -> None:
        """The model candidates waiting for the judge (Candidate.to_record), replacing the last list."""
        atomic_write(self.root / WAITING, json.dumps({"candidates": records}, indent=1) + "\n")

    def installed_verdict(self) -> dict | None:
        """The recorded verdict, if it describes the engine.py that is actually there."""
        try:
            verdict = json.loads((self.root / VERDICT).read_text())
            source = self.engine.read_text()
        except (OSError, ValueError):
            return None
        return verdict if verdict.get("sha256") == sha256(source) else None

    def open_history(self, warn: Callable[[str], None]) -> None:
        """A git repository in the workspace, so `git log -p engine.py` shows how it evolved."""
        self.warn = warn
        self.repo = self._open_repo()

    def _open_repo(self):
        try:
            import git
        except ImportError:
            self.warn("gitpython is not installed: accepted engines are not committed to a history")
            return None
        try:
            repo = git.Repo(self.root) if (self.root / ".git").exists() else git.Repo.init(self.root)
            ignore = self.root / ".gitignore"
            if not ignore.exists():
                ignore.write_text(GIT_IGNORE)
            with repo.config_writer() as cfg:
                cfg.set_value("user", "name", GIT_AUTHOR[0])
                cfg.set_value("user", "email", GIT_AUTHOR[1])
            return repo
        except Exception as e:  # noqa: BLE001 - no git binary, odd permissions: history is optional
            self.warn(f"no git history in {self.root}: {e}")
            return None

    def commit(self, message: str) -> None:
        if self.repo is None:
            return
        try:
            paths = [p for p in (".gitignore", ENGINE, VERDICT, RESULTS_LOG, RESULTS_JSON) if (self.root / p).exists()]
            self.repo.index.add(paths)
            self.repo.index.commit(message)
        except Exception as e:  # noqa: BLE001 - a failed commit must not lose the engine
            self.warn(f"git commit failed: {e}")
