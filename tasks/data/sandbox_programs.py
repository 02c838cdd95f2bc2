"""The programs the sandbox's child processes run (tasks/data/sandbox.py starts them; its docstring gives the
design and the threat model).

- :data:`RUNNER`: the candidate's process. Confines itself (network namespace, rlimits, uid drop, an audit
  hook guard), executes the candidate's program, says it is ready, then serves calls: arguments in, the
  entry point's result out, both as plain data.
- :data:`CHECKER`: the checker's process. Runs trusted code only (the task's context and its tests), with
  ``check`` given a stand-in for the entry point that forwards every call to the candidate's process.
- :data:`CODEC`: how values cross between the two, prepended to both (each side trusts only its own copy).
- :data:`PROBE`: a candidate program that reports which confinements are in force (``sandbox.enforcement``).

They are source text, written to files and run by a fresh ``python -I -B``; nothing here is imported by them.
"""

#: The candidate's process (see the module docstring).
RUNNER = r'''
import builtins, json, os, resource, signal, sys, traceback

def _main(real_exit=os._exit, err=sys.stderr):
    cfg = json.loads(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    try:
        if cfg["netns"]:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            flags = 0x40000000 if os.geteuid() == 0 else 0x40000000 | 0x10000000
            libc.unshare(flags)
            del libc
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if cfg["uid"] is not None:
            sys.path[:] = [_reachable(e) for e in sys.path]
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        sys.addaudithook(_make_guard(os.path.realpath(".")))
    except BaseException:
        traceback.print_exc(file=err)
        err.flush()
        real_exit(3)

    def _no_exit(code=0):
        raise SystemExit("os._exit is not allowed in the sandbox")

    os._exit = _no_exit
    import posix
    posix._exit = _no_exit
    ns = {"__name__": "__main__", "__builtins__": builtins}
    code = 0
    try:
        exec(compile(job["program"], "<program>", "exec"), ns)
        fn = ns[job["entry_point"]]
    except BaseException:
        code = 1
        try:
            traceback.print_exc(file=err)
        except BaseException:
            pass
    if code == 0:  # serve the checker's calls: arguments in, results out, plain data both ways
        requests, write = os.fdopen(cfg["req_fd"], "rb"), os.write
        write(cfg["resp_fd"], b'{"ready": true}\n')
        for line in requests:
            try:
                call = _dec(json.loads(line))
                out = {"ok": _enc(fn(*call["args"], **call["kwargs"]))}
            except BaseException as e:
                out = {"error": type(e).__name__, "message": str(e)[:500]}
            data = (json.dumps(out) + "\n").encode()
            while data:
                data = data[write(cfg["resp_fd"], data):]
    for stream in (sys.stdout, err):
        try:
            stream.flush()
        except BaseException:
            code = code or 1
    real_exit(code)


def _reachable(entry):
    """An import path the dropped uid can use: a /proc/self/fd link for a dir it cannot traverse to."""
    import stat
    if not entry or not os.path.isdir(entry):
        return entry
    parts = os.path.abspath(entry).split(os.sep)
    for i in range(2, len(parts) + 1):
        if not os.stat(os.sep.join(parts[:i])).st_mode & stat.S_IXOTH:
            return "/proc/self/fd/%d" % os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    return entry


def _make_guard(workdir):
    W = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    PATH_EVENTS = {"os.mkdir": (0,), "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,),
                   "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
                   "os.mknod": (0,), "os.mkfifo": (0,), "os.chflags": (0,), "os.setxattr": (0,),
                   "os.removexattr": (0,), "shutil.rmtree": (0,)}
    BLOCKED = frozenset({"os.link", "os.symlink", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                         "subprocess.Popen", "os.killpg", "os.forkpty", "pty.spawn", "socket.__new__",
                         "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                         "socket.getaddrinfo", "socket.gethostbyname", "gc.get_objects",
                         "gc.get_referrers", "gc.get_referents", "sys._current_frames", "os.chroot",
                         "sys.remote_exec"})

    def guard(event, args, wd=workdir, wds=workdir + os.sep, realpath=os.path.realpath,
              fspath=os.fspath, isdir=os.path.isdir, getpid=os.getpid, fsdecode=os.fsdecode,
              isinstance=isinstance, int=int, str=str, bytes=bytes, W=W, PE=PermissionError,
              PATH_EVENTS=PATH_EVENTS, BLOCKED=BLOCKED):
        def inside(p):
            if p is None or isinstance(p, int):
                return True
            p = fspath(p)
            if isinstance(p, bytes):
                p = fsdecode(p)
            r = realpath(p)
            return r == wd or r.startswith(wds) or r == "/dev/null"
        if event in BLOCKED or event.startswith("ctypes."):
            raise PE(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (flags & W) if isinstance(flags, int) else False
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                writes = True
            if writes and not inside(path):
                raise PE(f"sandbox: writing outside the working directory: {path!r}")
            if mode is None and not isinstance(path, int) and not inside(path) and isdir(path):
                raise PE(f"sandbox: os.open of a directory outside the working directory: {path!r}")
        elif event in PATH_EVENTS:
            for i in PATH_EVENTS[event]:
                if i < len(args) and not inside(args[i]):
                    raise PE(f"sandbox: {event} outside the working directory: {args[i]!r}")
        elif event == "os.kill":
            if args[0] != getpid():
                raise PE("sandbox: signalling other processes is not allowed")
    return guard

_main()
'''

#: How values cross between the candidate and the checker: JSON with tags for the plain Python types JSON
#: lacks. Only exact builtin types pass (an ``int`` subclass with its own ``__eq__`` does not); anything
#: else is a ``TypeError``. The same source runs in both processes; the checker trusts only its own copy.
CODEC = r'''
import math as _math


def _enc(x):
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if abs(x) < 2 ** 53 else {"int": str(x)}
    if t is float:
        return x if _math.isfinite(x) else {"float": repr(x)}
    if t is list:
        return [_enc(v) for v in x]
    if t is tuple:
        return {"tuple": [_enc(v) for v in x]}
    if t is set or t is frozenset:
        return {t.__name__: [_enc(v) for v in x]}
    if t is dict:
        return {"dict": [[_enc(k), _enc(v)] for k, v in x.items()]}
    if t is bytes:
        return {"bytes": x.hex()}
    if t is complex:
        return {"complex": [x.real, x.imag]}
    raise TypeError("not plain data: " + t.__name__)


def _dec(x):
    t = type(x)
    if x is None or t in (bool, str, int, float):
        return x
    if t is list:
        return [_dec(v) for v in x]
    if t is dict and len(x) == 1:
        (tag, v), = x.items()
        if tag == "int" and type(v) is str:
            return int(v)
        if tag == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "tuple" and type(v) is list:
            return tuple(_dec(e) for e in v)
        if tag in ("set", "frozenset") and type(v) is list:
            return (set if tag == "set" else frozenset)(_dec(e) for e in v)
        if tag == "dict" and type(v) is list and all(type(kv) is list and len(kv) == 2 for kv in v):
            return {_dec(k): _dec(e) for k, e in v}
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
    if t is dict and set(x) == {"args", "kwargs"}:  # a call: {"args": [...], "kwargs": {"dict": ...}}
        return {"args": _dec(x["args"]), "kwargs": _dec(x["kwargs"])}
    raise TypeError("not plain data: " + repr(x)[:100])
'''

#: The checker: trusted code only (the task's context, e.g. HumanEval's prompt with its helpers, and its
#: tests), in a process the candidate never ran in. ``candidate(...)`` sends the arguments to the candidate
#: process and returns what came back, decoded by this process's own codec; an error there is raised here.
CHECKER = r'''
import builtins, json, os, sys


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one, or its process ended."""


def _main():
    cfg = json.loads(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    requests = os.fdopen(cfg["req_fd"], "wb", buffering=0)
    replies = os.fdopen(cfg["resp_fd"], "rb")

    def candidate(*args, **kwargs):
        requests.write((json.dumps({"args": _enc(list(args)), "kwargs": _enc(kwargs)}) + "\n").encode())
        line = replies.readline()
        if not line:
            raise CandidateError("the candidate's process ended before answering")
        out = json.loads(line)
        if type(out) is dict and set(out) == {"ok"}:
            return _dec(out["ok"])
        exc = getattr(builtins, str(out.get("error")), None) if type(out) is dict else None
        if not (isinstance(exc, type) and issubclass(exc, Exception)):
            exc = CandidateError
        raise exc(str(out.get("message", "")) if type(out) is dict else "malformed reply")

    if replies.readline() != b'{"ready": true}\n':  # the candidate's program loaded (it may have said so
        raise CandidateError("the candidate's program did not load")  # only by loading: the line is fixed)
    ns = {"__name__": "__main__"}
    exec(compile(job["context"], "<context>", "exec"), ns)
    exec(compile(job["test"], "<test>", "exec"), ns)
    ns[job["entry_point"]] = candidate
    ns["check"](candidate)


_main()
'''


#: A candidate program reporting the confinements in force, from inside the sandbox.
PROBE = '''
import os, resource, socket
def probe():
    out = {"uid": os.getuid(), "rlimits": {n: resource.getrlimit(getattr(resource, n))[0] for n in
           ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_NOFILE")}}
    with open("/proc/self/net/dev") as fh:
        out["interfaces"] = sorted(ln.split(":")[0].strip() for ln in fh if ":" in ln)
    out["netns"] = os.readlink("/proc/self/ns/net")
    out["pidns"] = os.readlink("/proc/self/ns/pid")
    out["sees"] = sorted(os.listdir("/"))
    try:
        socket.socket()
        out["socket"] = "allowed"
    except PermissionError as e:
        out["socket"] = "refused"
    return out
'''
