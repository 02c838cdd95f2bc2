"""Processes and their lifetimes: which process a run lives in (:class:`ProcessMark`, kept in the ledger's run row
so a reader can tell a run whose process is gone from one still running), and children that die with their parent
(:func:`die_with_parent`: Prefect's temporary API server, ``rlsift worker``'s Prefect worker).

Light on purpose (stdlib and psutil): ``rlsift ledger`` uses it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import psutil

#: A process's start time as psutil reads it (``/proc/<pid>/stat``, in clock ticks) may differ by this much between
#: two reads of the same process; two processes that share a pid start further apart than this.
START_TOLERANCE_S = 1.0


@dataclass(frozen=True)
class ProcessMark:
    """One process, told apart from any later process that reuses its pid: its ``pid``, the ``host`` it runs on
    (``socket.gethostname()``) and its start time (``started``, seconds since the epoch, psutil's
    ``create_time``)."""

    pid: int
    host: str
    started: float

    @classmethod
    def current(cls) -> ProcessMark:
        """This process."""
        return cls(pid=os.getpid(), host=socket.gethostname(), started=psutil.Process().create_time())

    def gone(self) -> bool:
        """True when this process no longer runs: its pid is free, or another process (started at another time)
        holds it, or it is a zombie. False while it runs, and for a process of another host (it cannot be
        looked at from here)."""
        if self.host != socket.gethostname():
            return False
        try:
            p = psutil.Process(self.pid)
            return (abs(p.create_time() - self.started) > START_TOLERANCE_S
                    or p.status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return True
        except psutil.AccessDenied:  # another user's process holds the pid now: not ours
            return True


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """For ``subprocess.Popen(preexec_fn=...)``: the child gets SIGKILL when its parent dies, ``kill -9`` included
    (Linux ``PR_SET_PDEATHSIG``, through libc's ``prctl``; elsewhere None: nothing). ``parent``: the pid of the
    process that starts the child (``os.getpid()``); a child whose parent died before the signal was armed exits
    at once.

    The kernel sends the signal when the *thread* that forked the child ends: start the child from the main
    thread (whose end is the process's end), not from a worker thread that may end first."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os._exit(1)

    return arm
