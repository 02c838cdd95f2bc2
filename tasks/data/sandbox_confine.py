"""What the host does to confine one sandboxed job: its :class:`Limits`, the uid pool and the per-uid sweep, the
rlimits the runner sets, and the bubblewrap command line.

tasks/data/sandbox.py runs the job and its module docstring gives the design and the threat model; the confinement
the candidate applies to itself (network namespace, audit hook) is in tasks/data/sandbox_programs.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed job.

    Attributes:
        timeout_s: wall-clock limit; the process group is SIGKILLed after it.
        cpu_s: RLIMIT_CPU soft limit in seconds (hard = soft + 1); None means ``int(timeout_s) + 2``.
        memory_bytes: RLIMIT_AS (address space).
        file_bytes: RLIMIT_FSIZE: largest file the job may write, which also caps stdout and stderr.
        max_processes: RLIMIT_NPROC budget (processes and threads) for the job.
        max_open_files: RLIMIT_NOFILE.
        stderr_tail_chars: how much of the end of stderr the verdict keeps.
        uid_base: first uid of the pool used when running as root (one uid per concurrent job,
            locked across processes; uids with an account are skipped).
        uid_slots: size of that pool (the most jobs that can run at once on the machine).
        network_namespace: try ``unshare(CLONE_NEWNET)``.
        isolation: run the candidate under bubblewrap (see tasks/data/sandbox.py's module docstring) when ``bwrap``
            is found.
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_bytes: int = 1 << 30
    file_bytes: int = 4 << 20
    max_processes: int = 32
    max_open_files: int = 64
    stderr_tail_chars: int = 2000
    uid_base: int = 61000
    uid_slots: int = 64
    network_namespace: bool = True
    isolation: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("memory_bytes", "file_bytes", "max_processes", "max_open_files", "uid_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class UidPool:
    """Hands out one unprivileged uid per concurrent job (only used when running as root).

    Uids that belong to an account are skipped. A uid is held with an exclusive ``flock`` on a file
    in a root-only folder, so sandboxes in other processes never share (or sweep) a uid in use.
    """

    def __init__(self, base: int, slots: int) -> None:
        self.uids = [u for u in range(base, base + slots) if not _has_account(u)]
        if not self.uids:
            raise ValueError(f"every uid in [{base}, {base + slots}) belongs to an account; change uid_base")
        self._dir = Path(tempfile.gettempdir()) / "rlsift-sandbox-uids"
        self._dir.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}

    def acquire(self) -> int:
        while True:
            with self._lock:
                for uid in self.uids:
                    if uid in self._held:
                        continue
                    fd = os.open(self._dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    self._held[uid] = fd
                    return uid
            time.sleep(0.02)

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


_POOLS: dict[tuple[int, int], UidPool] = {}
_POOLS_LOCK = threading.Lock()


def uid_pool(limits: Limits) -> UidPool:
    key = (limits.uid_base, limits.uid_slots)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = UidPool(*key)
        return _POOLS[key]


def processes_of(uid: int) -> list[int]:
    """Pids of live (not zombie) processes whose real uid is ``uid`` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                status = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        state, uids = status.get("State", "").split(), status.get("Uid", "").split()
        if uids and int(uids[0]) == uid and state and state[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def sweep_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is ``uid``, in rounds until none is left.

    Each round kills every process seen, so a survivor can only be one forked during the round by
    a process that is now dead; RLIMIT_NPROC bounds how many such there are.
    """
    for _ in range(100):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    raise RuntimeError(f"could not kill the processes of sandbox uid {uid}: {processes_of(uid)}")


def rlimits(limits: Limits, uid: int | None) -> list[tuple[str, int, int]]:
    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
    nproc = limits.max_processes
    if uid is None:  # RLIMIT_NPROC counts all of this user's processes: leave room for the existing ones
        nproc += len(processes_of(os.getuid()))
    return [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
            ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes), ("RLIMIT_NPROC", nproc, nproc),
            ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files), ("RLIMIT_CORE", 0, 0)]


#: System directories the isolated candidate sees (read-only); the rest of the host's tree is not there.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_warned_no_bwrap = False


def base_interpreter() -> str:
    """The base Python interpreter (not a virtual environment's link to it): with ``-I`` the runner needs
    only the standard library, so neither the venv nor the checkout that may hold it must be visible."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def under_bubblewrap(argv: list[str], mounts: Sequence[Path], work: Path, root: bool) -> list[str]:
    """``argv`` wrapped in bubblewrap (tasks/data/sandbox.py's module docstring), or unchanged when bwrap is
    missing or off.

    ``mounts``: files the candidate reads (its runner); ``work``: its working folder, the only writable one.
    """
    global _warned_no_bwrap
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        if not _warned_no_bwrap:
            _warned_no_bwrap = True
            logging.getLogger("rlsift.sandbox").warning(
                "bubblewrap (bwrap) not found: sandboxed code runs without operating-system isolation "
                "(install Debian's 'bubblewrap'; README, 'Code rewards')")
        return argv
    out = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
           "--unshare-uts", "--unshare-cgroup-try"]
    out += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root else ["--unshare-user"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        out += ["--ro-bind", prefix, prefix]
    out += ["--proc", "/proc", "--dev", "/dev"]
    for m in mounts:
        out += ["--ro-bind", str(m), str(m)]
    return [*out, "--bind", str(work), str(work), "--chdir", str(work), "--", *argv]
