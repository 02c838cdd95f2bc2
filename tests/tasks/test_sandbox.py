"""The code sandbox: real HumanEval programs pass, empty bodies fail, hostile programs stay contained."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tasks.data.sandbox import CodeJob, Verdict, enforcement, run_tests, score_many
from tasks.data.sandbox_confine import Limits, processes_of
from tasks.data.sources import read_source

HUMANEVAL = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"
ROOT = os.geteuid() == 0
CALL = "def check(f):\n    f()\n"  # test code: just call the entry point


def run(program: str, test: str = CALL, **kw) -> Verdict:
    return run_tests(program, test, "f", **kw)


@pytest.fixture(scope="module")
def humaneval():
    if not HUMANEVAL.exists():
        pytest.skip(f"{HUMANEVAL} not present")
    records, rejected = read_source(HUMANEVAL)
    assert len(records) == 164 and not rejected
    return records


def test_all_humaneval_canonical_solutions_pass(humaneval):
    jobs = [CodeJob(r.question + r.meta["canonical_solution"], r.answer, r.meta["entry_point"], context=r.question)
            for r in humaneval]
    t0 = time.perf_counter()
    verdicts = score_many(jobs, workers=4)
    elapsed = time.perf_counter() - t0
    failing = [(r.meta["task_id"], v.verdict, v.stderr_tail[-200:])
               for r, v in zip(humaneval, verdicts, strict=True) if not v.passed]
    print(f"HumanEval canonical: {164 - len(failing)}/164 passed in {elapsed:.1f} s")
    assert failing == []
    assert elapsed < 60  # measured about 5-7 s on 2 cores; not marked slow


def test_humaneval_empty_bodies_fail(humaneval):
    jobs = [CodeJob(r.question + "    pass\n", r.answer, r.meta["entry_point"], context=r.question)
            for r in humaneval]
    verdicts = score_many(jobs, workers=4)
    assert [v.verdict for v in verdicts] == ["failed"] * 164


def test_verdicts_and_order():
    jobs = [CodeJob("def f(x):\n    return x + 1\n", "def check(c):\n    assert c(1) == 2\n", "f"),
            CodeJob("def f(x):\n    return x\n", "def check(c):\n    assert c(1) == 2\n", "f"),
            CodeJob("def f(x):\n    return (\n", "def check(c):\n    pass\n", "f"),
            CodeJob("def g(x):\n    return x\n", "def check(c):\n    pass\n", "f")]
    v = score_many(jobs, workers=2)
    assert [x.verdict for x in v] == ["passed", "failed", "failed", "failed"]
    assert "AssertionError" in v[1].stderr_tail and "SyntaxError" in v[2].stderr_tail
    assert "KeyError" in v[3].stderr_tail  # entry point missing


def test_a_program_that_does_not_parse_fails_before_any_process_starts(monkeypatch):
    """The parser's verdict needs no sandbox: no process is started for it (Popen would raise here), its message is
    the stderr; a null byte alike. A program that parses but does not compile ('return' outside a function: the
    compiler's error, not the parser's) still goes to the sandbox, which fails it: the parse decides only failures."""
    def no_process(*a, **kw):
        raise AssertionError("a process was started")

    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", no_process)
        v = run("def f(:\n    return 1\n")
        assert v.verdict == "failed" and not v.passed and v.returncode is None
        assert "does not parse (not run): SyntaxError" in v.stderr_tail
        assert run("def f():\n    return 1\x00\n").verdict == "failed"
        with pytest.raises(AssertionError, match="a process was started"):
            run("return 1\n")  # parses: the sandbox's to judge
    v = run("return 1\n")
    assert v.verdict == "failed" and "SyntaxError" in v.stderr_tail and v.returncode is not None


def test_a_batch_runs_each_distinct_job_once_and_keeps_the_order(monkeypatch):
    """A group's identical completions are one job: run once, its verdict given to each copy in place."""
    from tasks.data import sandbox

    calls = []
    real = sandbox.run_tests
    monkeypatch.setattr(sandbox, "run_tests", lambda program, *a, **kw: calls.append(program) or real(program, *a,
                                                                                                         **kw))
    right = CodeJob("def f(x):\n    return x + 1\n", "def check(c):\n    assert c(1) == 2\n", "f")
    wrong = CodeJob("def f(x):\n    return x\n", right.test, "f")
    v = score_many([right, wrong, right, right, wrong], workers=2)
    assert [x.verdict for x in v] == ["passed", "failed", "passed", "passed", "failed"]
    assert sorted(calls) == sorted([right.program, wrong.program])
    assert score_many([], workers=2) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="entry_point"):
        run_tests("x = 1", CALL, "not an identifier")
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        score_many([], workers=0)


def test_early_exit_cannot_fake_a_pass():
    # os._exit(0) before the tests ran would otherwise look like success (exit status 0)
    v = run("import os\ndef f():\n    os._exit(0)\n", "def check(f):\n    f()\n    assert False\n")
    assert v.verdict == "failed" and "os._exit is not allowed" in v.stderr_tail
    v = run("import sys\nsys.exit(0)\ndef f():\n    pass\n")
    assert v.verdict == "failed"


def test_enforcement_report():
    e = enforcement()
    print("sandbox enforcement:", e)
    assert e["socket"] == "refused"
    assert e["rlimits"]["RLIMIT_AS"] == Limits().memory_bytes
    assert e["rlimits"]["RLIMIT_FSIZE"] == Limits().file_bytes
    if ROOT:
        assert e["uid"] != 0 and e["rlimits"]["RLIMIT_NPROC"] == Limits().max_processes
        assert e["netns"] is True and e["interfaces"] == ["lo"]


# --- hostile programs -------------------------------------------------------------------------

def test_infinite_loop_times_out():
    v = run("def f():\n    while True:\n        pass\n", timeout_s=1.0)
    assert v.verdict == "timeout" and 1.0 <= v.seconds < 3.0


def test_cpu_limit_is_a_timeout():
    # the wall limit is far away; RLIMIT_CPU (1 s) sends SIGXCPU first
    v = run("def f():\n    while True:\n        pass\n", limits=Limits(timeout_s=20.0, cpu_s=1))
    assert v.verdict == "timeout" and v.seconds < 10


#: The fork bomb's own uid pool, apart from the default one that other tests' jobs (another xdist worker's) use at
#: the same time: the sweep's check counts only the bomb's processes.
BOMB = Limits(timeout_s=2.0, uid_base=Limits().uid_base + Limits().uid_slots, uid_slots=2)


def _sandbox_uid_processes(lim: Limits = BOMB) -> list[int]:
    return [pid for uid in range(lim.uid_base, lim.uid_base + lim.uid_slots) for pid in processes_of(uid)]


def test_fork_bomb_is_contained():
    bomb = ("import os, time\n"
            "def f():\n"
            "    n = 0\n"
            "    while True:\n"
            "        try:\n"
            "            if os.fork() == 0:\n"
            "                os.setsid()  # try to leave the process group the parent kills\n"
            "            else:\n"
            "                n += 1\n"
            "        except (OSError, PermissionError):\n"
            "            time.sleep(0.01)\n")
    v = run(bomb, limits=BOMB)
    assert v.verdict == "timeout"
    if ROOT:
        assert _sandbox_uid_processes() == []  # the per-uid sweep killed even the setsid() escapees
    # the host can still start processes and run a normal job
    assert run("def f():\n    pass\n").passed


def test_memory_hog_fails_and_host_is_fine():
    hog = "def f():\n    chunks = []\n    while True:\n        chunks.append(bytearray(50 * 2**20))\n"
    v = run(hog, limits=Limits(timeout_s=10.0, memory_bytes=256 << 20))
    assert v.verdict in ("failed", "crashed") and v.seconds < 10
    assert "MemoryError" in v.stderr_tail or v.verdict == "crashed"
    assert run("def f():\n    x = bytearray(10 * 2**20)\n").passed


def test_huge_output_is_capped():
    lim = Limits(file_bytes=1 << 20)
    v = run("import sys\ndef f():\n    while True:\n        sys.stdout.write('x' * 65536)\n", limits=lim)
    assert v.verdict == "failed" and v.seconds < 5  # EFBIG at the file-size limit, not a timeout
    v = run("import sys\ndef f():\n    while True:\n        sys.stderr.write('y' * 65536)\n", limits=lim)
    assert v.verdict == "failed" and len(v.stderr_tail) <= lim.stderr_tail_chars


def test_writing_outside_the_working_directory_fails(tmp_path):
    outside = tmp_path / "open-to-all"
    outside.mkdir()
    outside.chmod(0o777)  # even a directory anyone may write to is refused
    targets = [outside / "escape.txt", Path("/tmp") / f"rlsift-escape-{uuid.uuid4().hex}"]
    for target in targets:
        v = run(f"def f():\n    open({str(target)!r}, 'w').write('pwned')\n")
        assert v.verdict == "failed" and "PermissionError" in v.stderr_tail
        assert not target.exists()
    v = run(f"import os\ndef f():\n    os.mkdir({str(outside / 'd')!r})\n")
    assert v.verdict == "failed" and not (outside / "d").exists()
    v = run(f"import os\ndef f():\n    os.symlink({str(outside)!r}, 'link')\n    open('link/x', 'w')\n")
    assert v.verdict == "failed" and not (outside / "x").exists()
    # inside its own fresh directory, writing works
    v = run("import os\ndef f():\n    assert os.listdir('.') == []\n"
            "    open('ok.txt', 'w').write('fine')\n    assert open('ok.txt').read() == 'fine'\n")
    assert v.passed, v.stderr_tail


def test_network_connection_fails():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        v = run(f"import socket\ndef f():\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        assert v.verdict == "failed"
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()
    v = run("import urllib.request\ndef f():\n    urllib.request.urlopen('http://1.1.1.1', timeout=2)\n")
    assert v.verdict == "failed"


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("RLSIFT_TEST_SECRET", "hunter2")
    program = ("import os\ndef f():\n"
               "    assert 'RLSIFT_TEST_SECRET' not in os.environ\n"
               "    assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'PWD'}, sorted(os.environ)\n")
    v = run(program)
    assert v.passed, v.stderr_tail
    v = run("import os\ndef f():\n    raise RuntimeError(repr(dict(os.environ)))\n")
    assert "hunter2" not in v.stderr_tail


def test_killing_the_parent_is_contained():
    v = run("import os, signal\ndef f():\n    os.kill(os.getppid(), signal.SIGKILL)\n")
    assert v.verdict == "failed"
    v = run("import os, signal\ndef f():\n    os.kill(-1, signal.SIGKILL)\n")
    assert v.verdict == "failed"
    assert run("def f():\n    pass\n").passed  # still alive, still scoring


def test_ctypes_and_subprocess_are_refused():
    v = run("import ctypes\ndef f():\n    ctypes.CDLL(None).kill(0, 9)\n")
    assert v.verdict == "failed" and "PermissionError" in v.stderr_tail
    v = run("import subprocess\ndef f():\n    subprocess.run(['sh', '-c', 'echo hi'])\n")
    assert v.verdict == "failed"


def test_uid_pool_never_hands_out_a_uid_held_elsewhere():
    from tasks.data.sandbox_confine import UidPool

    first, second = UidPool(62000, 2), UidPool(62000, 2)  # stand-ins for two processes' pools
    a = first.acquire()
    b = second.acquire()  # the flock on a's file is held through another open file: skip it
    assert {a, b} == {62000, 62001}
    first.release(a)
    assert second.acquire() == a
    second.release(a)
    second.release(b)


# --- forging a pass (the verdict comes from a process the candidate never ran in) -------------------------

ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 5) == 7\n"
FORGERIES = {
    "the runner's real exit through __main__": (
        "import sys\nsys.modules['__main__']._main.__defaults__[0](0)\ndef add(a, b):\n    return 42\n"),
    "the runner's real exit through the caller's frame": (
        "import sys\nf = sys._getframe(1)\nfor v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
        "    d = getattr(v, '__defaults__', None)\n    if d and callable(d[0]):\n        d[0](0)\n"
        "def add(a, b):\n    return 42\n"),
    "the real exit from a thread": (
        "import sys, threading\nex = sys.modules['__main__']._main.__defaults__[0]\n"
        "threading.Thread(target=lambda: ex(0)).start()\ndef add(a, b):\n    import time\n    time.sleep(1)\n"
        "    return 42\n"),
    "rewriting the tests through a frame": (
        "import sys\nf = sys._getframe(1)\nfor d in (f.f_locals, f.f_globals):\n    for v in list(d.values()):\n"
        "        if isinstance(v, dict) and 'test' in v:\n            v['test'] = 'def check(c):\\n    pass\\n'\n"
        "def add(a, b):\n    return 42\n"),
    "exec replaced by a no-op and its own check": (
        "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef check(c):\n    pass\n"
        "def add(a, b):\n    return 42\n"),
    "compile wrapped to swap the test code": (
        "import builtins\n_c = builtins.compile\n"
        "builtins.compile = lambda s, f, m, *a, **k: _c('def check(c):\\n    pass\\n' if f == '<test>' else s, f, m)\n"
        "def add(a, b):\n    return 42\n"),
    "an object equal to everything": (
        "class Any:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n    __lt__ = __le__ = __eq__\n"
        "    __sub__ = __rsub__ = lambda s, o: s\n    __abs__ = lambda s: 0\n    __bool__ = lambda s: True\n"
        "def add(a, b):\n    return Any()\n"),
    "an int subclass equal to everything": (
        "class I(int):\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return I(42)\n"),
    "writing fake replies on the results pipe": (
        "import json, os, sys\nfd = json.loads(sys.argv[1])['resp_fd']\n"
        "os.write(fd, b'{\"ready\": true}\\n{\"ok\": true}\\n{\"ok\": true}\\n')\ndef add(a, b):\n    return 42\n"),
}


@pytest.mark.parametrize("how", list(FORGERIES))
def test_a_wrong_program_cannot_forge_a_pass(how):
    v = run_tests(FORGERIES[how], ADD_TEST, "add", timeout_s=5.0)
    assert v.verdict != "passed", (how, v)
    assert run_tests("def add(a, b):\n    return a + b\n", ADD_TEST, "add").verdict == "passed"


def test_values_cross_as_plain_data_both_ways():
    program = ("def f(x):\n    return {'t': tuple(x), 's': {1, 2}, 'big': 2 ** 70, 'inf': float('inf'),\n"
               "            'b': b'\\x00', (1, 2): None, 'f': frozenset([3]), 'c': 1j}\n")
    test = ("def check(f):\n    out = f([1, 2])\n    assert out['t'] == (1, 2) and type(out['t']) is tuple\n"
            "    assert out['s'] == {1, 2} and out['big'] == 2 ** 70 and out['inf'] == float('inf')\n"
            "    assert out['b'] == b'\\x00' and out[(1, 2)] is None and out['f'] == frozenset([3])\n"
            "    assert out['c'] == 1j\n")
    assert run_tests(program, test, "f").verdict == "passed"
    raising = run_tests("def f():\n    raise ValueError('no')\n",
                        "def check(f):\n    try:\n        f()\n    except ValueError as e:\n"
                        "        assert str(e) == 'no'\n    else:\n        assert False\n", "f")
    assert raising.verdict == "passed"  # the candidate's builtin exception is raised in the checker


def test_tests_use_the_trusted_context_not_the_candidates():
    context = "def helper(x):\n    return x * 10\n"
    test = "def check(c):\n    assert helper(c(1)) == 20\n"
    honest = "def helper(x):\n    return x * 10\ndef f(x):\n    return x + 1\n"
    cheat = "def helper(x):\n    return 20\ndef f(x):\n    return 0\n"  # its own helper is not the one used
    assert run_tests(honest, test, "f", context=context).verdict == "passed"
    assert run_tests(cheat, test, "f", context=context).verdict == "failed"


# --- operating-system isolation (bubblewrap): the side doors of the in-process guard, as root and not ---------

CHECKOUT = Path(__file__).resolve().parents[2]
BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bubblewrap (bwrap) not installed: infra/setup.sh installs it")

#: Programs that try the side doors found by outside testing; each must leave no trace on the host and learn
#: nothing from it. ``{marker}`` is a fresh host path under /tmp, ``{secret}`` a host file the job must not
#: read, ``{victim}`` the pid of a host process it must not be able to signal.
SIDE_DOORS = {
    "dir_fd escape after chdir": (
        "import os\ndef f():\n    os.chdir('/')\n    d = os.open('/tmp', os.O_RDONLY)\n"
        "    fd = os.open('../tmp/{name}', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)\n    os.write(fd, b'x')\n"),
    "raw fork_exec of a shell": (
        "import os, sys, _posixsubprocess as p\ndef f():\n"
        "    args = [[b'/bin/sh', b'-c', b'echo pwned > {marker}'], [b'/bin/sh'], True, (), None, None,\n"
        "            -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None]\n"
        "    pid = p.fork_exec(*(args + [False] if sys.version_info < (3, 12) else args))\n"
        "    os.waitpid(pid, 0)\n"),
    "read the checkout, the ledger, a run folder": (
        "def f():\n    return open({secret!r}).read()\n"),
    "signal a host process by pid and pidfd": (
        "import os, signal\ndef f():\n"
        "    try:\n        signal.pidfd_send_signal(os.pidfd_open({victim}), signal.SIGKILL)\n"
        "    except OSError:\n        pass\n    os.kill({victim}, signal.SIGKILL)\n"),
}


def _side_door_program(how: str, marker: Path, secret: Path, victim: int) -> str:
    return SIDE_DOORS[how].format(marker=marker, name=marker.name, secret=str(secret), victim=victim)


def _check_side_doors(results: dict[str, str], markers: dict[str, Path], victim) -> None:
    """No trace on the host and no host file read; the shell's own failure does not fail ``f``, so the raw
    fork_exec case may pass: what matters is that it wrote nothing where the host sees it."""
    for how, verdict in results.items():
        assert not markers[how].exists(), f"{how}: wrote {markers[how]} on the host"
        assert how == "raw fork_exec of a shell" or verdict == "failed", (how, verdict)
    assert victim.poll() is None, "a sandboxed job killed a host process"


@needs_bwrap
def test_side_doors_are_closed_by_the_operating_system(tmp_path):
    e = enforcement()
    assert e["isolation"] == "bubblewrap" and e["pid_namespace"] and e["netns"]
    assert CHECKOUT.parts[1] not in e["sees"] or CHECKOUT.parts[1] in ("tmp", "usr")
    secret = tmp_path / "ledger.duckdb"  # stands for the ledger / run folder (tmp_path is outside the job's view)
    secret.write_text("secret")
    victim = subprocess.Popen(["sleep", "60"])
    try:
        markers = {how: Path("/tmp") / f"rlsift-door-{uuid.uuid4().hex}" for how in SIDE_DOORS}
        results = {how: run(_side_door_program(how, markers[how], secret, victim.pid), timeout_s=5).verdict
                   for how in SIDE_DOORS}
        _check_side_doors(results, markers, victim)
        assert run(f"def f():\n    return open({str(CHECKOUT / 'README.md')!r}).read()\n").verdict == "failed"
    finally:
        victim.kill()


@needs_bwrap
def test_a_setsid_child_does_not_outlive_its_job():
    tag = f"{time.time() % 1:.9f}"[2:]  # a unique sleep length names the process
    program = (f"import os, time\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n"
               f"        time.sleep(int('{tag}') % 7 + 30.{tag})\n")
    run(program, timeout_s=5)
    time.sleep(0.2)
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, tag)]
    assert survivors == []


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


UNPRIVILEGED = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tasks.data.sandbox import enforcement, run_tests
programs = json.loads(sys.argv[2])
res = {how: run_tests(p, "def check(f):\\n    f()\\n", "f", timeout_s=5).verdict for how, p in programs.items()}
honest = run_tests("def add(a, b):\\n    return a + b\\n", "def check(c):\\n    assert c(1, 2) == 3\\n", "add").verdict
print(json.dumps({"results": res, "honest": honest, "enforcement": enforcement()}))
"""


@needs_bwrap
@pytest.mark.skipif(not ROOT or not Path("/usr/bin/python3").exists() or not shutil.which("runuser"),
                    reason="needs root (to become another user), runuser and a system Python")
def test_side_doors_are_closed_for_an_unprivileged_user():
    """The same hostile programs, run by a sandbox in a process of user ``nobody`` (no uid pool there)."""
    # World-readable on the host (so only isolation hides the run folder), and the sandbox's modules where
    # nobody can import them (a checkout may sit in a private folder; they need only the standard library).
    pkg = Path(tempfile.mkdtemp(prefix="rlsift-nobody-"))
    secret = pkg / "runs" / "metrics.jsonl"
    secret.parent.mkdir()
    secret.write_text("secret")
    for rel in ("tasks/__init__.py", "tasks/data/__init__.py", "tasks/data/sandbox.py",
                "tasks/data/sandbox_confine.py", "tasks/data/sandbox_programs.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CHECKOUT / rel, pkg / rel)
    for p in [pkg, *pkg.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    victim = subprocess.Popen(["sleep", "60"], user="nobody")  # the same user as the jobs: only isolation protects it
    markers = {how: Path("/tmp") / f"rlsift-door-{uuid.uuid4().hex}" for how in SIDE_DOORS}
    programs = {how: _side_door_program(how, markers[how], secret, victim.pid) for how in SIDE_DOORS}
    try:
        out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", UNPRIVILEGED,
                              str(pkg), json.dumps(programs)], cwd="/tmp", capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        _check_side_doors(report["results"], markers, victim)
        assert report["honest"] == "passed"
        e = report["enforcement"]
        assert e["uid"] == e["parent_uid"] != 0 and e["isolation"] == "bubblewrap" and e["pid_namespace"]
    finally:
        victim.kill()
        shutil.rmtree(pkg, ignore_errors=True)
