"""The operating system's fence around untrusted code: one confined worker process per judgement.

The judge never imports a candidate. It starts a worker process inside a `Jail` and talks to
it over a socket (evaluator/channel.py). The jail stacks layers; each says what it stops:

- **Own uid** (when the judge runs as root): a fresh uid no process or file uses. The worker
  cannot write the repository, the workspace, the weights, site-packages or the verdict (all
  owned by root), cannot signal, ptrace or read the memory of the judge or the agent, and all
  it leaves behind is findable by its uid. Every capability is dropped from its bounding set.
- **Its own view of private folders**: where Python or its packages lie under a folder others
  cannot enter (a pyenv in /root), a mount namespace covers that folder with an empty tmpfs
  into which only the way to Python is bound back (/root then holds .pyenv and nothing else).
  Where the kernel refuses a mount namespace, the worker keeps CAP_DAC_READ_SEARCH instead
  (it then reads what root can read, and still writes only what its uid owns).
- **No network, no shared System V IPC**: network and IPC namespaces of its own (as root;
  otherwise inside a user namespace where the kernel allows one); the namespace's own loopback
  is up, for a tensor-parallel engine's ranks, and reaches nothing of the host's.
- **Only its judge's GPUs**: where the judge was given GPUs by UUID (`CUDA_VISIBLE_DEVICES`, as
  the agent gives each judge one GPU of a host it shares with other judges: agent/screens.py),
  the device nodes of the host's other GPUs are covered, in the worker's mount namespace, by a
  file it cannot open: a process it starts without that variable still cannot reach them (the
  way a devices cgroup confines a job to its GPUs). Else every GPU node stays as it is.
- **Others' processes out of sight**: under a uid of its own (a root judge) and where it has a
  mount namespace of its own, the worker mounts a fresh /proc with `hidepid=invisible` (Linux
  5.8 and later, where each /proc mount has options of its own), so it sees only its own uid's
  processes: not the judge, not another jail's worker. Model code in a unit check had watched /proc for a judge's worker and burned
  the CPUs only while one ran, halving the score timed beside it (red-team helper, thirty-eighth
  session). An older kernel refuses the option and the layer is missing.
- **No new privileges** (PR_SET_NO_NEW_PRIVS): no setuid binary gives anything back.
- **No new namespaces** (a seccomp filter): no user namespace of its own, whose tmpfs mounts would hold
  memory the judge's watch cannot see.
- **Limits** (rlimits): file size, core dumps, processes of its uid, and on CPU with a CPU build
  of torch its address space; and always the judge watches the resident memory of every
  process of its uid (its children count too) against the memory cap.
- **Private scratch**: its own HOME, TMPDIR and compiler caches in a folder made for it, its
  working directory there, a clean environment (no LD_PRELOAD, no PYTHON* variables, no API
  keys), Python in isolated mode, no descriptor but the channel's.
- **Death with the judge** (PR_SET_PDEATHSIG), and at the end **nothing survives**: its session
  is killed, then every process of its uid and every orphan that was re-parented to the judge
  (a child subreaper), then the files its uid left in the shared temporary folders
  (evaluator/sweep.py).
- The judge itself is made non-dumpable, so a worker that shares its uid (no root) still cannot
  ptrace it or read /proc/<judge>/mem.

`layers()` names what this machine gave, for the log: the run works without the optional
layers, and says which ones it lacks.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evaluator import triton_cache
from evaluator.sweep import (SHARED_TEMP, children, forget_child, jail_prefix, kill_new_children, kill_uid, live_processes_of, processes,
                             remove_files_of, remove_tree, session_of, start_child, sweep_stale_jails)

REPO_ROOT = Path(__file__).resolve().parent.parent

# prctl options and capability numbers (linux/prctl.h, linux/capability.h)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_KEEPCAPS = 1, 4, 8
PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 36, 38, 47
PR_CAP_AMBIENT_RAISE = 2
CAP_DAC_READ_SEARCH, CAP_LAST = 2, 40
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWIPC, CLONE_NEWNS = 0x40000000, 0x10000000, 0x08000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1   # netdevice(7): an interface's flags
IFREQ_FLAGS = "16sH22x"   # struct ifreq with ifr_flags (its name, then a short, padded to 40 bytes)

FILE_SIZE_LIMIT = 512 * 2**20     # bytes one file of the worker may reach
PROCESS_LIMIT = 2048              # processes and threads of the worker's uid
UID_RANGE = (3_000_000, 2**31 - 2)  # fresh uids are drawn here: far above any account's
# What of the judge's environment the worker may see (everything else is dropped).
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES",
            "NVIDIA_DRIVER_CAPABILITIES", "TRITON_PTXAS_PATH", "TRITON_INTERPRET", "TORCH_CUDA_ARCH_LIST",
            # NVLink multicast kept off where the machine says so (a tensor-parallel engine's NCCL)
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
# OpenMP threads that sleep, not spin, while they wait: with the judge and the worker each
# holding a pool of torch threads on a CPU, spinning waiters take the cores from the threads
# doing the work, and one busy process beside them made a CPU evaluation 9x slower (103 s
# against 11-13 s, docs/benchmarks.md, fifteenth session); unloaded it costs nothing measurable.
# A default: a caller's own OMP_WAIT_POLICY is kept. Set before torch is imported (libgomp reads
# it once): by the judge (evaluator/evaluate.py) for itself, here for a CPU worker. A GPU worker
# gets libgomp's own wait policy, as the course's in-process harness has (and one thread fewer,
# JUDGE_CORES): there the candidate's host work is small torch ops between launches, and waking
# sleeping threads cost each small parallel region ~50 us (repeat_interleave of 4 counts 12 ->
# 64-79 us; python3 -m scripts.gpu worker-speed, thirty-fourth session), inside the judge's clock.
QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
# A GPU worker's torch threads leave this many cores to the judge: its thread spins on the channel
# through a timed trace, and libgomp's threads spin for a while after each parallel region, so a
# pool of one thread a core oversubscribed the machine by one spinning thread and the scheduler
# held a trace's request 0.1-4.7 ms before the worker ran it (H200 host, 16 cores; python3 -m
# scripts.gpu judge-split, thirty-fifth session). A caller's own OMP_NUM_THREADS or MKL_NUM_THREADS
# (torch reads either) is kept.
JUDGE_CORES = 1
_DEFAULTED: set[str] = set()   # QUIET_THREADS keys that quiet_threads() set in this process's environment
# The worker's user name for libraries that ask (getpass.getuser() reads USER/LOGNAME first):
# a fresh uid has no passwd entry, and torch.profiler's start asked pwd for it and raised
# "getpwuid(): uid not found", so the profiled pass never ran on a GPU (twenty-third session).
WORKER_USER = "judge-worker"


def quiet_threads(env: dict[str, str] | None = None) -> None:
    """QUIET_THREADS into `env` (default os.environ) where the caller has not chosen."""
    target = os.environ if env is None else env
    for key, value in QUIET_THREADS.items():
        if key not in target:
            target[key] = value
            if env is None:
                _DEFAULTED.add(key)


_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int = 0) -> bool:
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def die_with_parent() -> bool:
    """SIGKILL this process when its parent dies, even by SIGKILL (Linux; elsewhere False): the
    worker with the judge, the judge with the agent, the compile-ahead process with its worker."""
    try:
        return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except AttributeError:   # a libc without prctl
        return False


def protect_judge() -> None:
    """In the judge: not dumpable (no ptrace, no /proc/<pid>/mem for a same-uid worker), and a
    child subreaper (a worker's orphans, daemons included, become the judge's children, so the
    sweep finds them). Harmless where unsupported."""
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _reachable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the owners can reach `path` (every folder on the way
    searchable by others, the path itself readable by them)."""
    path = path.resolve()
    try:
        for folder in list(reversed(path.parents)):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def _files_readable_by_others(path: Path) -> bool:
    """For a folder, whether others may read every file in it (a Hugging Face folder's
    safetensors are written 0600 by their library, in a folder anyone may list)."""
    if not path.is_dir():
        return True
    try:
        return all(p.stat().st_mode & stat.S_IROTH for p in path.iterdir() if p.is_file())
    except OSError:
        return False


def _fresh_uid() -> int:
    """A uid no account, process or file in the shared temporary folders uses."""
    import pwd
    used = {int(f["Uid"].split()[0]) for _, f in processes() if "Uid" in f}
    while True:
        uid = random.SystemRandom().randrange(*UID_RANGE)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        if uid not in used:
            return uid


def _device_groups() -> list[int]:
    """Groups that own GPU device nodes others may not open: the worker joins them."""
    groups = set()
    for node in Path("/dev").glob("nvidia*"):
        try:
            st = node.stat()
        except OSError:
            continue
        if not st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_IWGRP and st.st_gid != 0:
            groups.add(st.st_gid)
    return sorted(groups)


@dataclass(frozen=True)
class JailSpec:
    """What the worker applies to itself first thing, before it imports anything heavy."""

    judge_pid: int
    uid: int | None = None
    groups: tuple[int, ...] = ()
    reach: tuple[str, ...] = ()         # paths behind folders others cannot enter (see _mount_view)
    address_space: int | None = None    # RLIMIT_AS in bytes, or None
    hidden: tuple[str, ...] = ()        # device nodes of GPUs the judge was not given (gpus_not_given)
    blocker: str | None = None          # a file of root's no one may open: what covers them
    file_size: int = FILE_SIZE_LIMIT
    processes: int = PROCESS_LIMIT

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "JailSpec":
        data = json.loads(text)
        data["groups"], data["reach"], data["hidden"] = tuple(data["groups"]), tuple(data["reach"]), \
            tuple(data["hidden"])
        return JailSpec(**data)


def _set_capabilities(keep: int | None) -> None:
    """Effective, permitted and inheritable sets to {keep} (or empty), raised as ambient so that
    the compilers Triton starts can still reach headers under the same folders."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    mask = 0 if keep is None else 1 << keep
    data = (Data * 2)(Data(mask, mask, mask), Data(0, 0, 0))
    if _libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    if keep is not None and _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, keep, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "raising the ambient capability failed")


def _loopback_up() -> bool:
    """Bring up the loopback interface of the worker's own network namespace (a new namespace
    has it down): a tensor-parallel engine's ranks meet over it (gloo and NCCL rendezvous by TCP,
    templates/engine/tp.py.j2). It is the namespace's own: the host's 127.0.0.1 (a model server,
    another worker) is another interface in another namespace, out of reach. False where the
    kernel refuses."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack(IFREQ_FLAGS, b"lo", 0)
            flags = struct.unpack(IFREQ_FLAGS, fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ_FLAGS, b"lo", flags | IFF_UP))
    except OSError:
        return False
    return True


def _blocked_ancestors(path: Path) -> list[Path]:
    """The folders on the way to `path` (itself included) that others may not search."""
    return [p for p in [*reversed(path.parents), path] if p.is_dir() and not os.stat(p).st_mode & stat.S_IXOTH]


_OWN_MOUNTS: bool | None = None   # _own_mounts' answer, once asked


def _own_mounts() -> bool:
    """This process in a mount namespace of its own whose mounts reach no one else's (every
    mount private); once. False where the kernel refuses (no CAP_SYS_ADMIN)."""
    global _OWN_MOUNTS
    if _OWN_MOUNTS is None:
        _OWN_MOUNTS = _libc.unshare(CLONE_NEWNS) == 0 and _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
    return _OWN_MOUNTS


def gpus_not_given(visible: str | None = None, table: Path = Path("/proc/driver/nvidia/gpus"),
                   dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The device nodes (/dev/nvidiaN) of this host's GPUs that CUDA_VISIBLE_DEVICES (`visible`;
    default this process's) leaves out, where it names GPUs by UUID and the driver's table (each
    GPU's information file: its UUID and device minor) says which node is whose; else () (nothing
    to tell them by)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    given = {v.strip().lower() for v in visible.split(",") if v.strip()}
    if not given or not all(v.startswith("gpu-") for v in given):
        return ()
    minors = {}
    for info in table.glob("*/information"):
        try:
            text = info.read_text()
        except OSError:
            return ()
        uuid, minor = re.search(r"GPU UUID:\s*(\S+)", text), re.search(r"Device Minor:\s*(\d+)", text)
        if uuid and minor:
            minors[uuid.group(1).lower()] = int(minor.group(1))
    if not given <= minors.keys():
        return ()
    keep = {minors[g] for g in given}
    return tuple(sorted(str(node) for node in dev.glob("nvidia*")
                        if re.fullmatch(r"nvidia\d+", node.name) and int(node.name[6:]) not in keep))


def _cover(nodes: tuple[str, ...], blocker: str) -> bool:
    """Bind `blocker` (root's, mode 0) over each of `nodes` in this process's own mounts."""
    return _own_mounts() and all(_libc.mount(os.fsencode(blocker), os.fsencode(node), None, MS_BIND, None) == 0
                                 for node in nodes)


def _hide_others() -> bool:
    """A /proc of this process's own mounts that shows only its uid's processes. "invisible" is
    the per-mount option of Linux 5.8+; an older kernel, whose /proc options are one for the whole
    host, refuses the word instead of hiding the host's processes from everyone."""
    return _own_mounts() and _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                         b"hidepid=invisible") == 0


def _mount_view(paths: tuple[str, ...]) -> bool:
    """In a mount namespace of its own, make `paths` reachable for any uid without opening
    anything else: each folder on the way that others may not enter (a /root of mode 0700) is
    covered by an empty tmpfs of mode 0755 into which only the next folder on the way is bound
    back. The worker then sees /root holding .pyenv and nothing more. False where the kernel
    refuses (no CAP_SYS_ADMIN)."""
    if not _own_mounts():
        return False
    wanted = [Path(p) for p in paths]
    blocked = sorted({b for p in wanted for b in _blocked_ancestors(p)}, key=lambda b: len(b.parts))
    for folder in blocked:
        keep = sorted({folder / p.relative_to(folder).parts[0] for p in wanted
                       if folder in p.parents and p != folder})
        saved = [(child, os.open(child, os.O_PATH)) for child in keep]
        if _libc.mount(b"tmpfs", os.fsencode(folder), b"tmpfs", 0, b"mode=0755,size=64k") != 0:
            return False
        for child, fd in saved:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                child.mkdir()
            else:
                child.touch()
            ok = _libc.mount(os.fsencode(f"/proc/self/fd/{fd}"), os.fsencode(child), None, MS_BIND | MS_REC, None)
            os.close(fd)
            if ok != 0:
                return False
    return True


# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): the system calls that make namespaces
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
X32_SYSCALL_BIT = 0x40000000
# audit arch -> (unshare, setns, clone, clone3)
NAMESPACE_CALLS = {0xC000003E: (272, 308, 56, 435),    # x86_64
                   0xC00000B7: (97, 268, 220, 435)}    # aarch64
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def _arch() -> int | None:
    import platform
    return {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(platform.machine())


def _no_new_namespaces() -> bool:
    """A seccomp filter on this process and everything it starts: unshare and setns refused, clone
    refused with a CLONE_NEW* flag, clone3 answered ENOSYS (glibc then uses clone). A worker's
    child, single-threaded, had made a user namespace of its own and mounted a tmpfs there: memory
    no resident size shows and the judge's memory watch cannot see (red-team helper, thirty-ninth
    session). Needs PR_SET_NO_NEW_PRIVS first; False on an architecture not listed or where the
    kernel refuses."""
    arch = _arch()
    if arch not in NAMESPACE_CALLS:
        return False
    unshare, setns, clone, clone3 = NAMESPACE_CALLS[arch]
    eperm, enosys = SECCOMP_RET_ERRNO | 1, SECCOMP_RET_ERRNO | 38
    x32 = X32_SYSCALL_BIT if arch == 0xC000003E else 0xFFFFFFFF
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),            # 0: arch
        (BPF_JEQ, 0, 9, arch),              # 1: another arch's call (32-bit compat) -> EPERM
        (BPF_LD_W_ABS, 0, 0, 0),            # 2: nr
        (BPF_JGE, 7, 0, x32),               # 3: x32 calls -> EPERM
        (BPF_JEQ, 6, 0, unshare),           # 4
        (BPF_JEQ, 5, 0, setns),             # 5
        (BPF_JEQ, 5, 0, clone3),            # 6: -> ENOSYS
        (BPF_JEQ, 0, 2, clone),             # 7
        (BPF_LD_W_ABS, 0, 0, 16),           # 8: clone's flags (args[0], low half)
        (BPF_JSET, 1, 0, CLONE_NEW_FLAGS),  # 9
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),  # 10
        (BPF_RET, 0, 0, eperm),             # 11
        (BPF_RET, 0, 0, enosys),            # 12
    ]
    code = b"".join(struct.pack("HBBI", *insn) for insn in program)
    filters = ctypes.create_string_buffer(code, len(code))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(program), ctypes.addressof(filters))
    return _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0


def enter(spec: JailSpec) -> list[str]:
    """Confine the calling process (the worker, at its start). Returns the layers it holds; a
    required layer that fails raises (the worker then exits and the judge says why)."""
    held = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec.file_size, spec.file_size))
    if spec.address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (spec.address_space, spec.address_space))
        held.append(f"address space {spec.address_space / 2**30:.1f} GiB")
    held.append(f"file size {spec.file_size // 2**20} MiB")
    root = os.geteuid() == 0
    flags = CLONE_NEWNET | CLONE_NEWIPC if root else CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC
    if _libc.unshare(flags) == 0:
        held.append("no network (own network namespace" + (", its own loopback up)" if _loopback_up() else ")"))
        held.append("own System V IPC")
    keep = None
    if spec.reach:
        if _mount_view(spec.reach):
            held.append("own view of the private folders on the way to Python (nothing else of them)")
        else:   # no mount namespace here: read like root to reach Python, still write as itself
            keep = CAP_DAC_READ_SEARCH
    if spec.hidden and spec.blocker and _cover(spec.hidden, spec.blocker):
        held.append(f"only its judge's GPUs ({', '.join(spec.hidden)} out of reach)")
    if spec.uid is not None and _hide_others():
        held.append("others' processes out of sight (/proc hidepid)")
    if spec.uid is not None:
        for cap in range(CAP_LAST + 1):
            if cap != keep:
                _prctl(PR_CAPBSET_DROP, cap)
        _prctl(PR_SET_KEEPCAPS, 1 if keep is not None else 0)
        os.setgroups(list(spec.groups))
        os.setresgid(spec.uid, spec.uid, spec.uid)
        os.setresuid(spec.uid, spec.uid, spec.uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec.processes, spec.processes))
        _set_capabilities(keep)
        if os.getuid() != spec.uid or os.geteuid() != spec.uid:
            raise OSError("the worker's uid did not change")
        held.append(f"own uid {spec.uid}" + (" (reads like root, writes as itself)" if keep is not None else ""))
        held.append(f"processes {spec.processes}")
        _prctl(PR_SET_DUMPABLE, 1)   # its own /proc/self stays readable to itself
    if not _prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    held.append("no new privileges")
    if _no_new_namespaces():
        held.append("no new namespaces")
    die_with_parent()   # after the uid change, which clears it
    if os.getppid() != spec.judge_pid:
        os._exit(1)   # the judge is gone already
    held.append("dies with the judge")
    return held


def default_threads() -> int:
    """The torch threads a process of this machine gets by default: one a physical core (torch's
    own count, as this process has it unless someone chose), never more than the cores this
    process may run on."""
    cores = len(os.sched_getaffinity(0))
    torch = sys.modules.get("torch")
    return min(cores, torch.get_num_threads()) if torch is not None else cores


def worker_env(home: Path, device: str) -> dict[str, str]:
    """The worker's environment: ENV_KEEP of the judge's (on a GPU without the judge's own
    QUIET_THREADS default), the scratch home's folders, QUIET_THREADS on a CPU, on a GPU a core
    for the judge (JUDGE_CORES)."""
    cpu = device == "cpu"
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ and (cpu or k not in _DEFAULTED)}
    env.setdefault("PATH", os.defpath)
    if cpu:
        quiet_threads(env)
    elif "OMP_NUM_THREADS" not in env and "MKL_NUM_THREADS" not in env:   # torch reads either
        env["OMP_NUM_THREADS"] = str(max(1, default_threads() - JUDGE_CORES))
    tmp = home / "tmp"
    env.update(HOME=str(home), TMPDIR=str(tmp), TRITON_CACHE_DIR=str(home / ".triton"),   # Jail.compile_cache
               TRITON_HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), CUDA_CACHE_PATH=str(home / ".nv"),
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", USER=WORKER_USER, LOGNAME=WORKER_USER)
    return env


@dataclass
class Jail:
    """One worker's confinement: a scratch folder, a uid, the layers, the cleanup.

    `with Jail(device) as jail: proc = jail.spawn(argv, pass_fds)`: on leaving, nothing the
    worker started is left running and nothing it wrote is left behind."""

    device: str
    memory_bytes: int | None = None
    triton_cache: Path | None = None   # the judge's shared cache: the worker gets a copy (evaluator/triton_cache.py)
    cache_scope: tuple[str, ...] = ()  # the model-written variants its engine holds: the cache's layers it reads
    root: Path = field(init=False)
    home: Path = field(init=False)
    spec: JailSpec = field(init=False)
    proc: subprocess.Popen | None = field(init=False, default=None)
    log_path: Path = field(init=False)
    _children_before: set[int] = field(init=False)
    _memory_devs: dict = field(init=False, default_factory=dict)   # device -> memory-backed (resident_bytes)
    _disk_free: dict = field(init=False, default_factory=dict)     # device -> (a folder on it, free bytes at the start)
    _memory_used: dict = field(init=False, default_factory=dict)   # device -> (a memory-backed folder, bytes used at the start)

    def __post_init__(self):
        protect_judge()
        self._children_before = children()
        sweep_stale_jails()
        self.root = Path(tempfile.mkdtemp(prefix=jail_prefix()))
        os.chmod(self.root, 0o755)
        self.home = self.root / "home"
        (self.home / "tmp").mkdir(parents=True)
        # The judge's own file (in the judge's folder): the worker writes it only through the
        # descriptor it inherits, and cannot swap it for a link, a pipe or another file.
        self.log_path = self.root / "worker.log"
        uid = _fresh_uid() if os.geteuid() == 0 else None
        paths = sysconfig.get_paths()
        needs = [Path(sys.executable).resolve().parent, Path(os.__file__).resolve().parent,
                 Path(_torch_dir()).resolve().parent, Path(paths["include"]), REPO_ROOT / "evaluator"]
        needs += [Path(sysconfig.get_config_var("LIBDIR"))] if sysconfig.get_config_var("LIBDIR") else []
        reach = tuple(sorted({str(p) for p in needs if not _reachable_by_others(p)})) if uid is not None else ()
        cap = self.memory_bytes if self.device == "cpu" and _torch_is_cpu_build() else None
        groups = tuple(_device_groups()) if uid is not None else ()
        hidden = gpus_not_given() if uid is not None else ()
        blocker = self.root / "no-device"
        if hidden:
            blocker.touch(mode=0)   # no one's to open (the worker has no capability left to override it)
        self.spec = JailSpec(os.getpid(), uid, groups, reach, cap, hidden=hidden,
                             blocker=str(blocker) if hidden else None)
        if uid is not None:
            for path in (self.home, self.home / "tmp"):
                os.chown(path, uid, uid)
            os.chmod(self.home, 0o700)
        self.refresh_cache()
        for folder in (str(self.home), *SHARED_TEMP):
            try:
                dev, free = os.stat(folder).st_dev, _free_bytes(folder)
            except OSError:
                continue
            if _on_memory_fs(folder):   # memory: resident_bytes counts what it gains
                self._memory_used.setdefault(dev, (folder, _used_bytes(folder)))
            elif dev not in self._disk_free:
                self._disk_free[dev] = (folder, free)

    def over_limits(self) -> str | None:
        """Why the jail's processes must be stopped now (their memory past the cap, a disk they
        filled), or None: the judge's worker and the agent's unit check are watched alike."""
        if self.memory_bytes and self.resident_bytes() > self.memory_bytes:
            return f"used more than {self.memory_bytes / 2**30:.1f} GiB of memory (the cap)"
        filled = self.disk_filled()
        if filled is not None:
            return f"took too much of the free disk space of {filled} (more than half)"
        return None

    def disk_filled(self) -> str | None:
        """A folder whose file system the worker could write and whose free space fell by more
        than DISK_SHARE of what it was when the jail was made (and DISK_SLACK), or None. RLIMIT_FSIZE bounds a file, not
        their number: a worker's fallocate of 512 MiB files filled a host's disk in milliseconds and
        held it full for its whole verdict, while the agent (its log, its records, exit 3 on ENOSPC)
        and the judges of other GPUs (their workers' compiler caches) wrote beside it (red-team
        helper, thirty-ninth session)."""
        for folder, free in self._disk_free.values():
            try:
                if free - _free_bytes(folder) > max(DISK_SHARE * free, DISK_SLACK):
                    return folder
            except OSError:
                continue
        return None

    def refresh_cache(self, scope: tuple[str, ...] | None = None) -> None:
        """The shared Triton cache's entries the worker's cache lacks, copied in: at the jail's
        start, and again for a worker started ahead of its verdict (evaluator/resident.py's spare),
        which gets the kernels added since, and those of its engine's `scope`, before any
        candidate code runs in it."""
        if scope is not None:
            self.cache_scope = tuple(scope)
        if self.triton_cache is not None:
            triton_cache.seed(self.triton_cache, self.compile_cache, self.spec.uid, self.cache_scope)

    @property
    def compile_cache(self) -> Path:
        """The worker's TRITON_CACHE_DIR (in its home: it goes with the jail)."""
        return self.home / ".triton"

    def __enter__(self) -> "Jail":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def readable(self, path: str | Path) -> str:
        """A path the worker can read with the same content: `path` itself when it can, else a
        copy in the jail (a weight folder under a private home, pytest's 0700 temp folders).
        Always absolute: the worker's working directory is its scratch folder."""
        path = Path(path).resolve()
        if self.spec.uid is None or _reachable_by_others(path) and _files_readable_by_others(path):
            return str(path)
        copy = Path(tempfile.mkdtemp(dir=self.root, prefix="input-"))
        os.chmod(copy, 0o755)
        target = copy / path.name
        if path.is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copy2(path, target)
        for p in [target, *target.rglob("*")] if target.is_dir() else [target]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        return str(target)

    def spawn(self, argv: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
        """Start the worker: `python -I <argv...> <spec>`, its output to worker.log."""
        with open(self.log_path, "wb") as log:
            self.proc = start_child(lambda: subprocess.Popen(
                [sys.executable, "-I", *argv, self.spec.to_json()], cwd=self.home,
                env=worker_env(self.home, self.device),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                start_new_session=True))
        return self.proc

    def log_tail(self, limit: int = 3000) -> str:
        """The last `limit` bytes of the worker's output (a regular file of the judge's, opened
        without following links or blocking, whatever the worker did)."""
        try:
            fd = os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return ""
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            f.seek(max(f.seek(0, os.SEEK_END) - limit, 0))
            return f.read(limit).decode(errors="replace").strip()

    def resident_bytes(self) -> int:
        """Memory of the worker and everything it started (every process of its uid, or its session
        when it shares the judge's uid): children count against the cap too. Each process's own pages
        (anonymous and file-backed, as resident), and once each the memory-backed files (tmpfs,
        memfds, SysV segments) they hold open or map, and what the memory-backed shared folders
        (/dev/shm) gained since the jail's start (whoever's: a walk for its files can be led past
        them by decoys, and others write little there): held in memfds, 2 GiB had passed a 1 GiB cap unseen, and with no
        bound but the descriptor limit a worker could take the host's memory, whose OOM killer then
        picks the judge or the agent (red-team helper, thirty-ninth session)."""
        if self.proc is None:
            return 0
        if self.spec.uid is not None:
            pids = live_processes_of(self.spec.uid)
        else:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and session_of(int(p)) == self.proc.pid]
        total, seen = 0, set()
        for pid in pids:
            rss = _rss_kib(pid)
            if rss is None:
                continue
            anon, file, shmem = rss
            mapped = self._count_shared(f"/proc/{pid}/map_files", seen, _virtual_mappings(pid))
            total += (anon + file + (0 if mapped is not None else shmem)) * 1024
            total += (mapped or 0) + (self._count_shared(f"/proc/{pid}/fd", seen) or 0)
        for folder, used in self._memory_used.values():   # /dev/shm: what it gained since the jail's start
            try:
                total += max(_used_bytes(folder) - used, 0)
            except OSError:
                continue
        return total

    def _memory_backed(self, link: str, dev: int) -> bool:
        """Whether the file `link` (a /proc magic link) names lies on a memory-backed file system
        (statfs, once a device)."""
        if dev not in self._memory_devs:
            self._memory_devs[dev] = _on_memory_fs(link)
        return self._memory_devs[dev]

    def _count_shared(self, folder: str, seen: set, names: list[str] | None = None) -> int | None:
        """Bytes of the memory-backed regular files the links in `folder` (`names` of them, default
        all) name, each once (`seen`); None where the folder cannot be read (map_files needs
        CAP_SYS_ADMIN)."""
        try:
            if names is None:
                names = os.listdir(folder)
            elif names and not os.access(folder, os.R_OK | os.X_OK):
                return None
        except OSError:
            return None
        total = 0
        for name in names:
            link = f"{folder}/{name}"
            try:
                st = os.stat(link)
            except PermissionError:
                return None
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode) or key in seen or st.st_dev in self._memory_used:   # counted whole
                continue
            seen.add(key)
            if self._memory_backed(link, st.st_dev):
                total += st.st_blocks * 512
        return total

    def close(self) -> None:
        """Kill everything the worker started, remove everything its uid wrote."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            forget_child(self.proc.pid)
        if self.spec.uid is not None:
            kill_uid(self.spec.uid)
        kill_new_children(self._children_before)
        if self.spec.uid is not None:
            remove_files_of(self.spec.uid)
        remove_tree(self.root)

    def layers(self, held: list[str]) -> str:
        """One line for the log: the layers the worker holds, and the ones this machine lacks."""
        missing = []
        if self.spec.uid is None:
            missing.append("own uid (the judge is not root)")
        elif not any(h.startswith("others' processes") for h in held):
            missing.append("others' processes hidden (/proc hidepid: Linux 5.8+ and a mount namespace)")
        if not any(h.startswith("no network") for h in held):
            missing.append("network namespace (refused by this kernel or container)")
        if self.memory_bytes and self.spec.address_space is None:
            missing.append("address-space cap (not with a CUDA build of torch: resident memory watched)")
        text = "worker isolation: " + ", ".join(held)
        return text + (f"; missing: {', '.join(missing)}" if missing else "")


# statfs(2) magic numbers of file systems whose files are memory (a memfd or a SysV segment lies on
# the kernel's internal tmpfs)
MEMORY_FS_MAGIC = (0x01021994, 0x858458F6, 0x958458F6)   # tmpfs, ramfs, hugetlbfs


# The disk a worker may take on each file system it can write: DISK_SHARE of the free space at its
# jail's start, and DISK_SLACK whatever that is (others write too: a 512 MiB log of another verdict's).
DISK_SHARE = 0.5
DISK_SLACK = 2**30


def _free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _on_memory_fs(path: str) -> bool:
    """Whether `path` (followed, a /proc magic link too) lies on a memory-backed file system."""
    try:
        fd = os.open(path, os.O_PATH)
    except OSError:
        return False
    try:
        buf = ctypes.create_string_buffer(256)   # struct statfs; f_type first
        if _libc.fstatfs(fd, buf) != 0:
            return False
        return (ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF) in MEMORY_FS_MAGIC
    finally:
        os.close(fd)


def _rss_kib(pid: int) -> tuple[int, int, int] | None:
    """(RssAnon, RssFile, RssShmem) of a process in KiB, from /proc/<pid>/status; None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return tuple(int(fields.get(k, "0 kB").split()[0]) for k in ("RssAnon", "RssFile", "RssShmem"))
    except (OSError, ValueError, IndexError):
        return None


def _virtual_mappings(pid: int) -> list[str]:
    """The /proc/<pid>/map_files names of the process's mappings of files on a device-less file
    system (major 0: tmpfs, memfds, SysV segments among them), read from /proc/<pid>/maps: the
    rest (libraries, weights on disk) is file-backed resident memory already counted."""
    names, files = [], set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] != "0" and fields[3].startswith("00:") \
                        and (fields[3], fields[4]) not in files:   # one a file: a file mapped 60000 times is one stat
                    files.add((fields[3], fields[4]))
                    names.append(fields[0])
    except OSError:
        pass
    return names


def _used_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _torch_dir() -> str:
    import importlib.util
    spec = importlib.util.find_spec("torch")
    return str(Path(spec.origin).parent) if spec and spec.origin else sys.prefix


def _torch_is_cpu_build() -> bool:
    import torch
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None
