"""Run untrusted candidate programs against their tests: a contained candidate process and a separate checker.

A code reward is only verifiable if a wrong (or hostile) program can neither hurt the run that scores it
nor forge its verdict. A policy trained with RL learns whatever earns reward, so the threat model is a
program written to pass without being right: exiting 0 early, reaching the harness's exit function or
its frames, replacing ``exec``/``compile`` or the test source, returning an object that compares equal to
anything. HumanEval's harness (Chen et al. 2021, arXiv 2107.03374; github.com/openai/human-eval
``execution.py``) runs program, tests and ``check`` in one interpreter and trusts its exit status; all of
the above beat it. Here the verdict comes from a process the candidate never ran in:

* the **candidate** process (``python -I -B runner.py``, fresh process session) reads the program and the
  entry point from its stdin (never written to disk), confines itself (below), executes the program,
  says "ready" and then serves calls: it reads arguments from one pipe, calls the entry point, and
  writes the result to another;
* the **checker** process runs trusted code only: the task's ``context`` (HumanEval's prompt, for helpers
  such as ``poly`` that the tests use) and the ``test`` code, with ``check`` given a stand-in for the
  entry point that forwards each call. Values cross only as plain data (None, bool, int, float, str,
  bytes, complex, list, tuple, dict, set, frozenset; exact builtin types, decoded by the checker's own
  code), so an object that compares equal to everything cannot cross, and a builtin exception raised by
  the candidate is raised again in the checker;
* **passed** means the checker's ``check`` returned after the candidate's program had loaded. Whatever the
  candidate does to its own interpreter, exit status or pipes, it can only change the values it returns.

What is enforced, and by what (``enforcement()`` measures it on the running machine):

* operating-system isolation (``Limits.isolation``, on by default): the candidate runs under bubblewrap
  (``bwrap``, Debian's ``bubblewrap``; ``infra/setup.sh`` installs it where it can) in its own pid, mount,
  network, IPC and UTS namespaces (and, for a non-root user, a user namespace). Its filesystem is a fresh
  root with only the system directories (``/usr`` and the ``/bin``, ``/lib*``, ``/sbin`` links), the
  Python installation, a private ``/proc`` and a minimal ``/dev`` mounted read-only, plus its own working
  folder read-write: the checkout, the ledger, run folders, ``/tmp``, ``/etc`` and home folders are not
  there, so a path trick (``os.open`` with ``dir_fd``, a raw ``fork_exec``) finds nothing to read or write.
  It cannot see or signal any process outside its pid namespace, and when the job ends the namespace's
  first process dies and the kernel kills every process left in it, ``setsid`` or not. As root, bwrap
  keeps only ``CAP_SETUID``/``CAP_SETGID`` so the runner can drop to its pool uid (below); as any other user
  the user namespace maps the job to that user. Without ``bwrap`` on the machine the job falls back to the
  measures below alone, with a warning (once per process); ``enforcement()["isolation"]`` says which.

* wall clock: the parent waits ``timeout_s`` and then SIGKILLs the whole process group (the child is
  started with ``start_new_session=True``); verdict ``timeout``.
* CPU time, address space, file size, process count, open files, core dumps: ``resource.setrlimit``
  (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_CORE), set by the runner
  before any untrusted code runs; an unprivileged process cannot raise them again. SIGXCPU counts as
  ``timeout``; SIGXFSZ is ignored so an oversized write fails with EFBIG instead of killing the child.
* stdout/stderr cap: both go to files (outside the working directory) limited by RLIMIT_FSIZE; only
  the tail of stderr is read back.
* identity: when the parent is root, the runner drops to its own unprivileged uid/gid (one uid per
  concurrent job, from ``uid_base``), so RLIMIT_NPROC counts only that job's processes (a fork bomb is
  capped without starving parallel jobs), the child cannot signal the test process (EPERM) and cannot
  write where that uid may not. Import directories the uid cannot traverse to (an interpreter under
  a 0700 home) are opened before the drop and reached through ``/proc/self/fd/N``. After the job
  every process still owned by that uid is SIGKILLed (found in /proc), which also catches children
  that left the process group with ``setsid``.
* network: the runner calls ``unshare(CLONE_NEWNET)`` through ctypes (Python 3.11 has no
  ``os.unshare``), so the job sees only a down loopback device; unprivileged it tries
  ``CLONE_NEWUSER | CLONE_NEWNET``. Independently, an audit hook refuses socket creation.
* filesystem, processes, introspection: a ``sys.addaudithook`` guard (hooks cannot be removed) refuses
  opens for writing, mkdir/rename/remove/chmod/... outside the fresh temporary working directory,
  symlinks and hard links, exec/posix_spawn/subprocess, ``os.kill``/``killpg`` of any process but
  itself, every ``ctypes`` foreign call, and ``gc`` object enumeration (so the guard cannot be found
  and edited). ``os._exit`` is replaced so a program cannot fake a pass by exiting early with status 0.
* environment: the child gets a fresh environment (PATH, LANG, HOME and TMPDIR pointing at its
  working directory) and none of the parent's variables; ``-I`` also ignores ``PYTHON*`` variables
  and the user site directory.

Deviations and limits: the audit hook is defence in depth, not a security boundary (CPython's own
docs say so); when the parent is not root there is no uid separation and no per-uid sweep, so
RLIMIT_NPROC is set to the user's current process count plus ``max_processes`` and only the process
group is killed, and the candidate runs as the checker's user (it could signal it, which fails the job,
or, where ptrace is allowed between a user's processes, ptrace it: the audit hook refuses ``ctypes``).
Calls pass arguments by value: a test that relies on the candidate mutating an argument in place does not
see the mutation (no HumanEval test does). The checker runs the dataset's tests without the confinement.

**Before any process** (what the sandbox would only confirm): a program the interpreter cannot parse fails there,
with the parser's message, and no process starts (:func:`parse_failure`; the candidate's first act is to compile the
same source with the same interpreter's grammar, so its verdict would be ``failed`` too). The parent only parses,
never compiles to code or runs it, and this decides a failure, never a pass. A batch (:func:`score_many`) runs each
distinct job once and gives its verdict to every copy (a group's identical completions; a program whose result is
random gets one draw for all its copies).

The host's side of the confinement (:class:`~tasks.data.sandbox_confine.Limits`, the uid pool and sweep, the
rlimits, bubblewrap) is in tasks/data/sandbox_confine.py; the two child programs are in
tasks/data/sandbox_programs.py.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tasks.data import sandbox_programs as programs
from tasks.data.sandbox_confine import Limits, base_interpreter, rlimits, sweep_uid, uid_pool, under_bubblewrap

VERDICTS = ("passed", "failed", "timeout", "crashed")

#: Exit statuses of the child programs (tasks/data/sandbox_programs.py): an exception; the sandbox's setup failed.
_EXIT_FAILED = 1
_EXIT_SETUP = 3



@dataclass(frozen=True)
class Verdict:
    """Outcome of one job: ``verdict`` is one of ``VERDICTS``; ``seconds`` is wall time."""

    verdict: str
    seconds: float
    stderr_tail: str = ""
    returncode: int | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"


@dataclass(frozen=True)
class CodeJob:
    """One program with its tests: ``check(<entry_point>)`` must return without raising. ``context``: trusted
    code the tests may use (HumanEval: the prompt), run by the checker, never by the candidate."""

    program: str
    test: str
    entry_point: str
    context: str = ""




def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 4 * chars))
        return fh.read().decode("utf-8", errors="replace")[-chars:]


def run_tests(program: str, test: str, entry_point: str, timeout_s: float | None = None,
              limits: Limits | None = None, context: str = "") -> Verdict:
    """Test ``program``'s ``entry_point`` with ``check`` from ``test``: the candidate and the tests run in
    two processes (see the module docstring).

    Args:
        program: the candidate's full Python source (for HumanEval: prompt + completion); runs sandboxed.
        test: trusted test code defining ``check(candidate)``; runs in the checker process.
        entry_point: name of the function in ``program`` that ``check`` calls.
        timeout_s: wall-clock limit; overrides ``limits.timeout_s`` when given.
        limits: resource limits of the candidate (defaults: ``Limits()``).
        context: trusted code the checker runs before ``test`` (HumanEval: the prompt, whose helpers such
            as ``poly`` the tests use); never the candidate's.

    Returns:
        ``passed`` (check returned), ``failed`` (an exception in the checker: a failed assertion, an error
        raised by the candidate, a result that is not plain data, the candidate's program failing to load or
        its process ending; or, without starting a process, a program that does not parse), ``timeout``
        (wall clock or the candidate's CPU time) or ``crashed`` (the candidate killed by any other signal, or
        the sandbox could not be set up).
    """
    limits = limits or Limits()
    if timeout_s is not None:
        limits = dataclasses.replace(limits, timeout_s=timeout_s)
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    if (failed := parse_failure(program, limits)) is not None:
        return failed
    root = os.geteuid() == 0
    pool = uid_pool(limits) if root else None
    uid = pool.acquire() if pool else None
    base = Path(tempfile.mkdtemp(prefix="rlsift-sandbox-"))
    try:
        end = _run_job(CodeJob(program, test, entry_point, context), base, limits, uid, root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if pool is not None and uid is not None:
            pool.release(uid)
    return _verdict(end, limits)


@dataclass(frozen=True)
class _JobEnd:
    """How the two processes of one job ended.

    Attributes:
        timed_out: the checker outlived the wall-clock limit and was killed.
        checker_rc: the checker's exit status.
        candidate_rc: the candidate's exit status (negative: the signal that ended it), or None when it was
            still running after the checker ended (or the job timed out).
        seconds: wall time from starting the candidate to the checker's end.
        stderr_tail, checker_tail: the ends of the candidate's and the checker's stderr.
    """

    timed_out: bool
    checker_rc: int
    candidate_rc: int | None
    seconds: float
    stderr_tail: str
    checker_tail: str


def _run_job(job: CodeJob, base: Path, limits: Limits, uid: int | None, root: bool) -> _JobEnd:
    """Run the candidate and the checker of ``job`` in the folder ``base``, wait for them and kill what is left.

    The candidate runs as ``uid`` when given (the parent is root); its working folder is ``base/w``, the
    checker's ``base/c``. They talk through two pipes that only the two children hold.
    """
    os.chmod(base, 0o711)
    work, checks = base / "w", base / "c"
    work.mkdir(mode=0o700)
    checks.mkdir(mode=0o700)
    if uid is not None:
        os.chown(work, uid, uid)
    (base / "runner.py").write_text(programs.CODEC + programs.RUNNER)
    (base / "checker.py").write_text(programs.CODEC + programs.CHECKER)
    req_r, req_w = os.pipe()  # checker -> candidate: calls
    resp_r, resp_w = os.pipe()  # candidate -> checker: results
    fds = [req_r, req_w, resp_r, resp_w]
    try:
        cfg = {"netns": limits.network_namespace, "rlimits": rlimits(limits, uid), "uid": uid,
               "req_fd": req_r, "resp_fd": resp_w}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work),
               "TMPDIR": str(work)}
        with open(base / "out", "wb") as out, open(base / "err", "wb") as err, \
                open(base / "check-err", "wb") as check_err:
            t0 = time.perf_counter()
            argv = [base_interpreter(), "-I", "-B", str(base / "runner.py"), json.dumps(cfg)]
            wrapped = under_bubblewrap(argv, [base / "runner.py"], work, root) if limits.isolation else argv
            isolated, argv = wrapped is not argv, wrapped
            cand = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work, env=env,
                                    start_new_session=True, close_fds=True, pass_fds=(req_r, resp_w))
            pipes = json.dumps({"req_fd": req_w, "resp_fd": resp_r})
            checker = subprocess.Popen(
                [sys.executable, "-I", "-B", str(base / "checker.py"), pipes], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=check_err, cwd=checks,
                env={**env, "HOME": str(checks), "TMPDIR": str(checks)}, start_new_session=True, close_fds=True,
                pass_fds=(req_w, resp_r))
            for fd in fds:  # only the two children hold the pipes: either one ending ends the other's reads
                os.close(fd)
            fds = []
            _send(cand, {"program": job.program, "entry_point": job.entry_point})
            _send(checker, {"context": job.context, "test": job.test, "entry_point": job.entry_point})
            timed_out, rc, cand_rc = _wait(cand, checker, limits.timeout_s, isolated)
            seconds = time.perf_counter() - t0
            _killpg(cand.pid)
            cand.wait()
            _killpg(checker.pid)
        if uid is not None:
            sweep_uid(uid)
        return _JobEnd(timed_out, rc, cand_rc, seconds, _tail(base / "err", limits.stderr_tail_chars),
                       _tail(base / "check-err", limits.stderr_tail_chars))
    finally:
        for fd in fds:
            os.close(fd)


def _wait(cand: subprocess.Popen, checker: subprocess.Popen, timeout_s: float,
          isolated: bool) -> tuple[bool, int, int | None]:
    """Wait for the checker (killing it after ``timeout_s``), then briefly for the candidate.

    Returns:
        (timed out, the checker's exit status, the candidate's exit status or None while it still runs); a
        candidate under bubblewrap that a signal ended gets that signal's negative number, as without it.
    """
    timed_out = False
    try:
        rc = checker.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _killpg(checker.pid)
        rc = checker.wait()
    cand_rc = None
    if not timed_out:
        try:  # the candidate ends when the checker closes its end of the calls
            cand_rc = cand.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    if isolated and cand_rc is not None and cand_rc > 128:  # bwrap reports its child's signal as 128 + n
        cand_rc = 128 - cand_rc
    return timed_out, rc, cand_rc


def parse_failure(program: str, limits: Limits) -> Verdict | None:
    """``failed`` for a program this interpreter cannot parse (the parser's message as its stderr), without starting
    a process; None for one it parses, which only the sandbox can judge. Parsing runs none of the program (no code
    object is made); the source is a completion of at most ``rollout.max_new_tokens`` after a trusted prompt, and
    the parser's own limits (nesting depth, a recursion limit) end as errors here, not as a crash."""
    t0 = time.perf_counter()
    try:
        ast.parse(program, "<program>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:  # ValueError: a null byte in the source
        text = f"{type(err).__name__}: {err}"
        return Verdict(verdict="failed", seconds=time.perf_counter() - t0,
                       stderr_tail=f"the program does not parse (not run): {text}"[-limits.stderr_tail_chars:])
    return None


def _verdict(end: _JobEnd, limits: Limits) -> Verdict:
    """The verdict of a job from how its processes ended (see :func:`run_tests`)."""
    tail = end.stderr_tail
    if end.timed_out or end.candidate_rc == -signal.SIGXCPU:
        verdict = "timeout"
    elif end.candidate_rc == _EXIT_SETUP:
        verdict, tail = "crashed", "sandbox setup failed:\n" + tail
    elif end.candidate_rc is not None and end.candidate_rc < 0:
        verdict = "crashed"
    elif end.checker_rc == 0:
        verdict = "passed"
    elif end.checker_rc == _EXIT_FAILED:
        verdict = "failed"
    else:
        verdict = "crashed"
    joined = "\n".join(t for t in (tail, end.checker_tail) if t)[-limits.stderr_tail_chars:]
    return Verdict(verdict=verdict, seconds=end.seconds, stderr_tail=joined, returncode=end.checker_rc)


def _send(proc: subprocess.Popen, job: dict) -> None:
    """Write a job to a child's stdin and close it (a child that already ended is not an error here)."""
    try:
        proc.stdin.write(json.dumps(job).encode("utf-8"))
    except BrokenPipeError:
        pass
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def score_many(jobs: Sequence[CodeJob], workers: int = 4, limits: Limits | None = None) -> list[Verdict]:
    """Run many jobs in parallel (threads, each waiting on its own child process), each distinct job once; order
    is kept.

    Args:
        jobs: the jobs, length J.
        workers: concurrent child processes (at most ``limits.uid_slots`` when running as root).
        limits: shared limits for every job.

    Returns:
        J verdicts, in the order of ``jobs``.
    """
    limits = limits or Limits()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    distinct = list(dict.fromkeys(jobs))  # each distinct job once, in first-seen order (module docstring)
    workers = min(workers, limits.uid_slots, max(1, len(distinct)))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        verdicts = dict(zip(distinct, ex.map(
            lambda j: run_tests(j.program, j.test, j.entry_point, limits=limits, context=j.context), distinct),
            strict=True))
    return [verdicts[j] for j in jobs]


def enforcement(limits: Limits | None = None) -> dict:
    """Measure, from inside a sandboxed job, which confinements are in force on this machine.

    Returns:
        dict with ``uid`` (the job's uid; differs from the parent's when uid separation works),
        ``rlimits`` (soft limits seen by the job), ``interfaces`` (network devices visible: only
        ``lo`` inside a fresh network namespace), ``socket`` (``refused`` by the audit hook),
        ``parent_uid``, ``netns`` (True when the job runs in its own network namespace), ``isolation``
        (``"bubblewrap"`` when the job runs under it, else ``"none"``), ``sees`` (the top-level folders the
        job can see; the host's other ones are not there) and ``pid_namespace`` (the job is pid 1's
        descendant in its own pid namespace: it sees no process of the host).
    """
    test = "def check(probe):\n    import json\n    raise AssertionError(json.dumps(probe()))\n"
    v = run_tests(programs.PROBE, test, "probe", limits=limits)  # probe() runs in the candidate's process
    line = [ln for ln in v.stderr_tail.splitlines() if ln.startswith("AssertionError: ")]
    if not line:
        raise RuntimeError(f"sandbox probe did not report ({v.verdict}): {v.stderr_tail[-500:]}")
    out = json.loads(line[-1][len("AssertionError: "):])
    out["parent_uid"] = os.getuid()
    out["netns"] = out["netns"] != os.readlink("/proc/self/ns/net")
    out["isolation"] = "bubblewrap" if (limits or Limits()).isolation and shutil.which("bwrap") else "none"
    out["pid_namespace"] = out.pop("pidns") != os.readlink("/proc/self/ns/pid")
    return out
