"""Child side of isolate: run one episode under the agent's own interpreter.

Started by the parent as ``<python> -I boot.py``, which imports this file from its cached
bytecode and calls ``main()``; ``<python> -I shim.py`` does the same. Standard library only,
Python 3.9+, so it runs in an agent virtualenv that has neither isolate nor pydantic. Lifecycle:

1. Keep a private copy of fd 1 for protocol frames; point fd 1 and ``sys.stdout`` at stderr,
   so nothing the agent (or any process it starts) prints can reach the protocol pipe.
2. Read one handshake line from stdin, then point fd 0 at /dev/null and keep a private copy of
   the parent's pipe: EOF on it means the parent died.
3. Answer ``hello`` with our protocol version; stop on a mismatch.
4. Become a child subreaper (Linux), so processes that double-fork or ``setsid()`` away from the
   agent are re-parented here and stay inside the episode.
5. Check the rest of the handshake, then contain: join the episode's cgroups before creating
   any process; with ``pidns``, fork PID 1 of a new PID namespace (with a private /proc), which
   carries on as the supervisor while this process only relays SIGTERM and its exit.
6. Fork the worker, which enters its Landlock domain (with ``landlock``: from then on nothing
   it runs can signal or ptrace a process outside), sets the episode's rlimits, imports and
   calls the entrypoint and
   writes a ``result`` or ``error`` frame. The supervisor reaps orphans, enforces its own
   deadline, watches the parent pipe, and when the worker is gone kills every survivor and
   sends ``done``.

Frames are single JSON lines carrying the handshake's nonce. See docs/protocol.md.
"""

import gc
import os
import select
import sys
import time

try:
    # The C module that signal.py wraps in enums; it is loaded at start-up already, while
    # importing signal.py costs 0.6 ms.
    import _signal as signal
except ImportError:
    import signal

# Every episode pays for the shim's imports on its launch path. So asyncio (~40 ms), ctypes,
# json, numbers, resource and traceback are imported where used, and re not at all.

HERE = os.path.dirname(os.path.abspath(__file__))

MAX_HANDSHAKE_BYTES = 512 * 1024 * 1024
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
# What a root agent keeps, as Docker's default does: file ownership and permissions, setuid and
# setgid, kill, raw and low-port sockets, chroot, mknod, audit writes, file capabilities. All
# act inside the episode only; every other capability reaches past it. Bits of capability.h.
KEPT_CAPABILITIES = (0, 1, 3, 4, 5, 6, 7, 10, 13, 18, 27, 29, 31)
CAP_SETPCAP = 8
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
# After the parent's pipe closes, survivors get at most this long after SIGTERM (seconds):
# the parent promises its tree is gone within cancel_grace + 2 s of its own death.
PARENT_GONE_GRACE = 1.0


def load_part(name):
    """Import the child-side part ``agent_shim/shim_<name>.py`` as ``_isolate_shim_<name>``.

    Parts are loaded on demand, from their cached bytecode, under a private name: the agent may
    have a module called ``shim_<name>`` of its own, and it must find its own.
    """
    private = "_isolate_shim_" + name
    module = sys.modules.get(private)
    if module is not None:
        return module
    public = "shim_" + name
    theirs = sys.modules.pop(public, None)
    sys.path.insert(0, HERE)
    try:
        module = __import__(public)
    finally:
        sys.path.remove(HERE)
        sys.modules.pop(public, None)  # absent when the import failed
        if theirs is not None:
            sys.modules[public] = theirs
    module.__name__ = private
    sys.modules[private] = module
    return module


# The protocol's constants and the containment grammar, shared with the parent.
wire = load_part("wire")
PROTOCOL_VERSION, CANCEL, LAYERS = wire.PROTOCOL_VERSION, wire.CANCEL, wire.LAYERS
MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS = wire.MAX_MESSAGE_CHARS, wire.MAX_TRACEBACK_CHARS


class Channel:
    """The private protocol pipe: one JSON line per frame, written whole."""

    def __init__(self, fd, nonce):
        self.fd = fd
        self.nonce = nonce

    def send(self, frame_type, info_json=None, **fields):
        """``info_json``: the agent's extra info, as JSON text already."""
        fields["t"] = frame_type
        fields["nonce"] = self.nonce
        text = to_json(fields)
        if info_json is not None:
            text = text[:-1] + ', "info": ' + info_json + "}"
        view = memoryview((text + "\n").encode("utf-8", "backslashreplace"))
        while view:
            view = view[os.write(self.fd, view) :]

    def send_fds(self, frame_type, fds, **fields):
        """A frame with ``fds`` attached to its bytes (SCM_RIGHTS on the protocol socket)."""
        import socket

        fields["t"] = frame_type
        fields["nonce"] = self.nonce
        data = (to_json(fields) + "\n").encode("utf-8", "backslashreplace")
        sock = socket.socket(fileno=os.dup(self.fd))
        try:
            sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
        finally:
            sock.close()
        view = memoryview(data)[sent:]
        while view:
            view = view[os.write(self.fd, view) :]


# --- JSON without importing json -------------------------------------------------------------
# In a plain virtualenv, importing json costs every start about 7 ms (it imports re and enum),
# as much as the rest of the shim. json's own C part (_json) does the work here instead; json
# itself only where that is missing, or for the agent's extra info.


def json_loads(text):
    """``json.loads(text)``, with the C scanner json.loads itself uses."""
    try:
        from _json import make_scanner
    except ImportError:  # not CPython
        import json

        return json.loads(text)

    class Defaults:  # what the scanner reads off a JSONDecoder: json.loads' defaults
        strict = True
        object_hook = object_pairs_hook = None
        parse_float, parse_int, parse_constant = float, int, float  # NaN, Infinity

    text = text.strip(" \t\n\r")
    try:
        value, end = make_scanner(Defaults)(text, 0)
    except Exception:
        # Malformed. The scanner's own errors need json.decoder loaded (3.11 even fails with
        # a SystemError without it), and json says best what is wrong: let it.
        end = -1
    if end != len(text):
        import json

        return json.loads(text)
    return value


def to_json(value):
    """``json.dumps(value, default=repr)`` for the shim's frames (their keys are str)."""
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:  # not CPython
        import json

        return json.dumps(value, default=repr)
    parts = []

    def add(v):
        if isinstance(v, str):
            parts.append(quote(v))
        elif v is None:
            parts.append("null")
        elif v is True or v is False:
            parts.append("true" if v else "false")
        elif isinstance(v, int):
            parts.append(int.__repr__(v))
        elif isinstance(v, float):
            if v != v:
                parts.append("NaN")
            elif v in (INF, -INF):
                parts.append("Infinity" if v > 0 else "-Infinity")
            else:
                parts.append(float.__repr__(v))
        elif isinstance(v, dict):
            parts.append("{")
            for i, (key, item) in enumerate(v.items()):
                parts.append("%s%s: " % (", " if i else "", quote(str(key))))
                add(item)
            parts.append("}")
        elif isinstance(v, (list, tuple)):
            parts.append("[")
            for i, item in enumerate(v):
                parts.append(", " if i else "")
                add(item)
            parts.append("]")
        else:
            parts.append(quote(repr(v)))

    add(value)
    return "".join(parts)


def read_handshake(fd):
    """The handshake line, and what came after it (a cancel request, or nothing)."""
    chunks, size = [], 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return None, b""  # parent gone before the handshake was complete
        newline = chunk.find(b"\n")
        if newline >= 0:
            chunks.append(chunk[:newline])
            return b"".join(chunks), chunk[newline + 1 :]
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_HANDSHAKE_BYTES:
            return None, b""


_c_functions = {}


def c_call(name, *args):
    """Call the C library's ``name`` with int, bytes (``char *``) or None (NULL) arguments;
    its int result and errno."""
    import _ctypes  # ctypes' C core: ctypes itself imports it, so it is there where ctypes is

    return c_call_function(name)(*args), _ctypes.get_errno()


def c_call_function(name):
    """Make (and keep) the C function ``c_call(name, ...)`` will call."""
    func = _c_functions.get(name)
    if func is None:
        func = _c_functions[name] = c_function(name)
    return func


def c_function(name):
    """Built on ctypes' C core directly, the way ctypes' CDLL does it: importing the ctypes
    package costs every start 1.7 ms, its C core 0.4 ms. Should that private interface ever
    change, ctypes itself."""
    try:
        import _ctypes

        class CInt(_ctypes._SimpleCData):
            _type_ = "i"

        class CFunction(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = CInt

        class Process:  # dlopen(NULL): the symbols of this process, libc's among them
            _handle = _ctypes.dlopen(None, os.RTLD_NOW)

        return CFunction((name, Process))
    except (AttributeError, TypeError, ValueError):
        import ctypes

        return getattr(ctypes.CDLL(None, use_errno=True), name)


def set_subreaper():
    if not sys.platform.startswith("linux"):
        return False
    try:
        return c_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)[0] == 0
    except (ImportError, OSError, AttributeError):
        return False


INF = float("inf")


def is_number(value):
    return type(value) in (int, float) and -INF < value < INF


def is_entrypoint(value):
    """``package.module:function``, each part a Python identifier."""
    if not isinstance(value, str) or value.count(":") != 1:
        return False
    return all(part.isidentifier() for half in value.split(":") for part in half.split("."))


def check_handshake(hs):
    """What is wrong with a handshake of our protocol version, or None."""
    checks = [
        ("entrypoint", is_entrypoint),
        ("data", lambda v: True),
        ("agent_root", lambda v: v is None or isinstance(v, str)),
        ("kwargs", lambda v: isinstance(v, dict)),
        ("secrets", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
        ("secret_env", is_env),
        ("temp_env", is_env),
        ("deadline", lambda v: is_number(v) and v > 0),
        ("kill_grace", lambda v: is_number(v) and v >= 0),
        ("cancel_grace", lambda v: is_number(v) and v >= 0),
        ("exit_grace", lambda v: is_number(v) and v >= 0),
        ("max_info_bytes", lambda v: type(v) is int and v >= 0),
        ("containment", is_containment),
        ("userns", lambda v: isinstance(v, bool)),
        ("cgroups", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
        ("rlimits", lambda v: isinstance(v, dict) and all(is_rlimit(*x) for x in v.items())),
        ("sandbox", lambda v: isinstance(v, dict)),
    ]
    for name, ok in checks:
        if name in hs or name in ("entrypoint", "data"):
            if name not in hs or not ok(hs[name]):
                return "invalid handshake: field %r is missing or has a wrong type" % name
    return None


def is_env(value):
    """Names and values a process environment can hold."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in value.items()
    )


def is_containment(value):
    # Not None: canonical_containment says None for what is not a containment at all.
    return isinstance(value, str) and wire.canonical_containment(value) == value


def layers_of(hs):
    """The containment layers the handshake asks for: ``["cgroup", "pidns"]``, say."""
    value = hs.get("containment", "session")
    return [] if value == "session" else value.split("+")


def is_rlimit(name, value):
    import resource

    return (
        name.startswith("RLIMIT_")
        and hasattr(resource, name)
        and isinstance(value, list)
        and len(value) == 2
        and all(type(x) is int and x >= 0 for x in value)
    )


# --- containment ------------------------------------------------------------------------------


def contain(hs):
    """Join the episode's cgroups; with pidns, fork PID 1 of a new PID namespace, and turn this
    process into a relay. Returns a problem, or None in the process that carries on. A
    template's fork (``forked``) lives in its template's PID namespace already."""
    problem = join_cgroups(hs.get("cgroups", ()))
    if problem is not None or "pidns" not in layers_of(hs) or hs.get("forked"):
        return problem
    problem = unshare_pidns(hs.get("userns", False))
    if problem is not None:
        return problem
    pid = os.fork()
    if pid:
        relay(pid)  # exits
    return become_init()


def join_cgroups(paths):
    """Be in each of these cgroup directories before creating any process; a problem or None."""
    me = str(os.getpid())
    for path in paths:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                if me in f.read().split():
                    continue  # the parent moved us in already
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(me)
        except OSError as exc:
            return "cannot join cgroup %s: %s" % (path, exc.strerror or exc)
    return None


def unshare_pidns(userns):
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWPID | CLONE_NEWNS | (CLONE_NEWUSER if userns else 0)
    result, errno = c_call("unshare", flags)
    if result != 0:
        return "unshare(%s): %s" % (
            "user+pid+mount" if userns else "pid+mount",
            os.strerror(errno),
        )
    return map_own_ids(uid, gid) if userns else None


def map_own_ids(uid, gid):
    """In a user namespace just made: map our own ids to themselves, so that files the agent
    writes keep the caller's ownership. A problem or None."""
    # The files of a process that is not dumpable belong to root: dumpable just for the opens
    # (what was opened stays writable), then at once not again.
    maps = (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)))
    maps += (("gid_map", "%d %d 1" % (gid, gid)),)
    files, problem = [], None
    c_call("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        for name, _ in maps:
            files.append(open("/proc/self/" + name, "w"))
    except OSError as exc:
        problem = exc
    finally:
        c_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    for i, f in enumerate(files):
        try:
            with f:
                if problem is None:
                    f.write(maps[i][1])
        except OSError as exc:
            problem = problem or exc
    if problem is not None:
        return "cannot map ids in the user namespace: %s" % (problem.strerror or problem)
    return None


def become_init():
    """In PID 1 of the new namespace: die with the relay; mount a /proc that shows only the
    namespace, or the supervisor's scan of /proc would see the whole machine."""
    c_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # C strings as bytes, NULL as None, the flags as an int: what c_call passes without ctypes
    # itself, whose import would cost every episode in a namespace ~2 ms.
    for args in (
        (None, b"/", None, MS_REC | MS_PRIVATE, None),
        (b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
    ):
        result, errno = c_call("mount", *args)
        if result != 0:
            return "cannot mount a private /proc: %s" % os.strerror(errno)
    return private_shm()


def private_shm():
    """A /dev/shm of the episode's own: the machine's is shared by every process, and what is
    left there outlives the episode. It goes with the mount namespace; its pages are charged to
    the cgroup of whoever writes them. A problem or None."""
    if not os.path.isdir("/dev/shm"):
        return None
    flags = MS_NOSUID | MS_NODEV
    result, errno = c_call("mount", b"tmpfs", b"/dev/shm", b"tmpfs", flags, b"mode=1777")
    if result != 0:
        return "cannot mount a private /dev/shm: %s" % os.strerror(errno)
    return None


def relay(child):
    """The outer half of a PID namespace: pass SIGTERM on to PID 1, exit as it exits."""
    pidfd = os.pidfd_open(child) if hasattr(os, "pidfd_open") else None

    def forward(*_):
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            else:
                os.kill(child, signal.SIGTERM)
        except OSError:
            pass  # PID 1 is gone already

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.WIFSIGNALED(status):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def enter_landlock():
    """Put this process (the worker, before anything of the agent runs) into a new Landlock
    domain scoped for signals and abstract unix sockets, handling no file or port access. The
    supervisor stays outside: the agent cannot signal it either. A problem or None."""
    landlock = load_part("landlock")
    landlock.use(c_call)  # the shim's calls: the part would import ctypes (~1.7 ms) otherwise
    scoped = landlock.SCOPED_BY_ABI[6]
    try:
        ruleset = landlock.create_ruleset(scoped=scoped)
    except (OSError, AttributeError) as exc:
        return "cannot create a Landlock ruleset: %s" % (getattr(exc, "strerror", None) or exc)
    try:
        landlock.restrict_self(ruleset)
    except OSError as exc:
        return "cannot enter a Landlock domain: %s" % (exc.strerror or exc)
    finally:
        os.close(ruleset)
    return None


# --- the worker -------------------------------------------------------------------------------


def worker(hs, channel):
    """Enter the Landlock domain, set the rlimits, import and call the entrypoint; exit code 0
    after a result, else the error's code."""
    # A template's forks share its PID namespace: each worker gets a domain of its own, so that
    # no episode can signal or trace another (``scoped``).
    if "landlock" in layers_of(hs) or hs.get("scoped"):
        problem = enter_landlock()
        if problem is not None:
            channel.send("error", kind="setup", type="ContainmentError", message=problem)
            return 1
    rlimits = sorted(hs.get("rlimits", {}).items())
    if rlimits:
        import resource
    for name, (soft, hard) in rlimits:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (OSError, ValueError) as exc:
            message = "cannot set %s to %s: %s" % (name, (soft, hard), exc)
            channel.send("error", kind="setup", type="LimitError", message=message)
            return 1
    # Only here, in the worker, after fork: never in an exec environment (/proc/PID/environ
    # keeps that one), but in os.environ for the agent's SDKs and its subprocesses.
    secret_env = hs.pop("secret_env", None) or {}
    os.environ.update(secret_env)
    temp_env = hs.get("temp_env")
    if temp_env:
        # A template's fork: the template's exec environment named another episode's
        # temporary directory, and the import may have had tempfile cache it.
        os.environ.update(temp_env)
        tempfile = sys.modules.get("tempfile")
        if tempfile is not None:
            tempfile.tempdir = None
    look_like_a_program(hs["entrypoint"])
    sandbox = hs.get("sandbox")
    if sandbox is not None:
        missing = []
        network = sandbox.get("network")
        if network is not None:
            part = load_part("net")
            problem = part.enter(network, channel, c_call, map_own_ids, capability_sets)
            if problem is not None:
                missing.append("network isolation: " + problem)
        # Last before the agent's import: the shim's own parts are loaded by now.
        missing += load_part("sandbox").enter(sandbox, load_part("landlock"), c_call)
        if missing and not sandbox.get("best_effort"):
            message = "sandbox: cannot enforce " + "; ".join(missing)
            channel.send("error", kind="setup", type="SandboxError", message=message)
            return 1
        channel.send("sandbox", missing=missing)
    if sys.platform.startswith("linux"):
        problem = harden()
        if problem is not None:
            channel.send("error", kind="setup", type="ContainmentError", message=problem)
            return 1
    try:
        # Cancellation arrives as SIGINT (blocked since before the fork, so none is lost).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        target = load_entrypoint(hs["entrypoint"], hs.get("agent_root"))
    except BaseException as exc:
        text = format_exc()
        sys.stderr.write(text)
        tried = "sys.path starts %s" % (sys.path[:3],)
        message = "cannot load entrypoint %s (%s): %s" % (hs["entrypoint"], tried, exc)
        values = list((hs.get("secrets") or {}).values()) + list(secret_env.values())
        fields = report(message, text, values)
        channel.send("error", kind="setup", type=type(exc).__name__[:200], **fields)
        return 1
    kwargs = dict(hs.get("kwargs") or {})
    secrets = hs.pop("secrets", None) or {}
    kwargs.update(secrets)
    try:
        value = target(hs["data"], **kwargs)
        del kwargs
        if hasattr(value, "__await__"):
            value = load_part("cancel").run_async(value)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are the agent's too
        if isinstance(exc, MemoryError):
            take_report_room(hs)
        text = format_exc()
        sys.stderr.write(text)  # the log keeps it too
        code = 1
        if isinstance(exc, SystemExit):
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        fields = report(_exc_message(exc), text, list(secrets.values()) + list(secret_env.values()))
        channel.send("error", kind="agent", type=type(exc).__name__[:200], **fields)
        return code & 0xFF
    limit = hs.get("max_info_bytes", 1 << 20)
    values = list(secrets.values()) + list(secret_env.values())
    channel.send("result", **to_result(value, limit, values))
    return 0


def harden():
    """The last step before the agent's code: a syscall filter (mounts, namespaces, other
    processes' memory and fds, kernel keys and modules...; shim_seccomp.py), then every
    capability that reaches past the episode dropped from all five sets, so that nothing the
    agent execs gets one back; the worker stays not dumpable. A problem, or None. A kernel
    without seccomp is said in the log, and the rest still holds."""
    problem = load_part("seccomp").install(c_call)
    if problem is not None:
        sys.stderr.write("isolate shim: no syscall filter: %s\n" % problem)
    problem = drop_capabilities()
    # The kernel resets it on some credential changes (commit_creds): once more, last.
    c_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    return problem


def capability_sets():
    """This process's capability sets from /proc/self/status: {"CapEff": int, ...}."""
    with open("/proc/self/status") as f:
        return {line[:6]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}


def drop_capabilities():
    """Keep at most KEPT_CAPABILITIES in every set, and none for an unprivileged trainer's
    agent (in its user namespace it holds them all). The bounding set needs CAP_SETPCAP, so it
    goes first, that one last. A problem or None."""
    keep = sum(1 << cap for cap in KEPT_CAPABILITIES) if os.getuid() == 0 else 0
    sets = capability_sets()
    c_call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    bounding = sets.get("CapBnd", 0) & ~keep
    if bounding and sets.get("CapEff", 0) >> CAP_SETPCAP & 1:
        for cap in range(64):
            if bounding >> cap & 1:
                result, errno = c_call("prctl", PR_CAPBSET_DROP, cap, 0, 0, 0)
                if result != 0 and errno != 22:  # EINVAL: a capability this kernel lacks
                    return "cannot drop capability %d: %s" % (cap, os.strerror(errno))
    # Without CAP_SETPCAP the bounding set stays; no_new_privs (set with the syscall filter
    # for such a process) keeps exec from granting anything from it.
    now = [sets.get(name, 0) for name in ("CapEff", "CapPrm", "CapInh")]
    effective, permitted, inheritable = (value & keep for value in now)
    if [effective, permitted, inheritable] == now:
        return None  # nothing to drop
    header = _LINUX_CAPABILITY_VERSION_3.to_bytes(4, "little") + (0).to_bytes(4, "little")
    data = b"".join(
        (value >> shift & 0xFFFFFFFF).to_bytes(4, "little")
        for shift in (0, 32)
        for value in (effective, permitted, inheritable)
    )
    result, errno = c_call("capset", header, data)
    if result != 0:
        return "cannot drop capabilities: %s" % os.strerror(errno)
    return None


def load_entrypoint(entrypoint, agent_root):
    """Import ``package.module:function`` with ``agent_root`` first on sys.path, then the
    PYTHONPATH the spec set (-I ignores it); the function. isolate doctor uses this too."""
    module_name, _, attr = entrypoint.partition(":")
    extra_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in reversed(([agent_root] if agent_root else []) + extra_path):
        sys.path.insert(0, entry)
    target = __import__(module_name, fromlist=["_"])
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError("%s is a %s, not a function" % (entrypoint, type(target).__name__))
    return target


# What of an error the parent keeps (characters): the start of its message, the end of its
# traceback (where it was raised). Cut here, so that the frame fits the parent's cap.


def report(message, traceback, secrets):
    """An error frame's message and traceback, cut to what the parent keeps; never through a
    secret (the log has both whole)."""
    room = 64  # for the note of what was cut: the whole stays within the parent's limit
    if len(message) > MAX_MESSAGE_CHARS:
        cut_at = len(cut(message, MAX_MESSAGE_CHARS - room, secrets))
        message = "%s [... %d more characters]" % (message[:cut_at], len(message) - cut_at)
    if len(traceback) > MAX_TRACEBACK_CHARS:
        start = len(traceback) - MAX_TRACEBACK_CHARS + room
        for secret in secrets:
            found = traceback.find(secret, max(0, start - len(secret) + 1)) if secret else -1
            if 0 <= found < start:
                start = found + len(secret)  # it spans the cut: keep none of it
        traceback = "[%d characters cut ...]\n%s" % (start, traceback[start:])
    return {"message": message, "traceback": traceback}


def leave_worker(code):
    """The worker's exit after its final frame: what plain python's exit does for a program,
    without tearing down every module. Non-daemon threads are joined, atexit hooks run
    (logging.shutdown, weakref.finalize: TemporaryDirectory, multiprocessing's), cyclic garbage
    is collected with its finalisers, files still open are closed (so flushed), then stdout and
    stderr; then os._exit. CPython's teardown would also deallocate every module's objects: for
    an agent that imported litellm, 110-180 ms of CPU, and in a template's fork a copy of each
    page it touches. Python does not promise finalisers of objects alive at exit anyway."""
    # First what the agent printed: a thread that never ends may get this exit killed.
    flush_std_streams()
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # what the interpreter's exit does first
    import atexit

    atexit._run_exitfuncs()
    gc.collect()
    close_open_files()
    flush_std_streams()
    os._exit(code)


def flush_std_streams():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def close_open_files():
    """Close the agent's file objects that are still open, as their deallocation would: text
    wrappers first, then buffered files, then raw ones, so each flushes into one still open.
    Objects that existed at the fork are frozen and not listed: the shim's own, and in a
    template's fork the import's (docs/templates.md: What a template shares)."""
    try:
        from _io import _BufferedIOBase, _IOBase, _TextIOBase  # C types: a quick check
    except ImportError:  # not CPython
        from io import BufferedIOBase as _BufferedIOBase
        from io import IOBase as _IOBase
        from io import TextIOBase as _TextIOBase
    standard = {id(f) for f in (sys.stdin, sys.stdout, sys.stderr)}
    standard.update(id(f) for f in (sys.__stdin__, sys.__stdout__, sys.__stderr__))
    # By type, never isinstance(): that reads __class__, which a lazy proxy may compute (a
    # litellm import has 370,000 objects: 45 ms this way, 850 ms by isinstance).
    found = [o for o in gc.get_objects() if issubclass(type(o), _IOBase) and id(o) not in standard]
    for kind in (_TextIOBase, _BufferedIOBase, _IOBase):
        for f in found:
            if issubclass(type(f), kind):
                try:
                    if not f.closed:
                        f.close()
                except Exception:
                    pass  # as at deallocation: a file that cannot be flushed loses its data


def take_report_room(hs):
    """After a MemoryError at the memory limit: raise the soft RLIMIT_DATA to the hard one,
    which the parent set higher for this, so that formatting and sending the report cannot
    fail for want of memory."""
    limit = hs.get("rlimits", {}).get("RLIMIT_DATA")
    if limit is None:
        return
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit[1], limit[1]))
    except (OSError, ValueError):
        pass  # the agent lowered its hard limit: report with what is left


def format_exc():
    import traceback

    return traceback.format_exc()


_boot_main = []  # the shim's own __main__, kept alive once the agent's replaces it


def look_like_a_program(entrypoint):
    """Give the agent what an ordinary program has: ``sys.argv == [entrypoint]`` and an empty
    ``__main__`` (no ``__file__``, ``__spec__`` None, as under ``python -c``). multiprocessing's
    spawn and forkserver children re-run ``__main__.__file__``: with the shim's, each would run
    the shim again."""
    main = type(sys)("__main__")
    main.__builtins__ = sys.modules["builtins"]
    _boot_main.append(sys.modules.get("__main__"))
    sys.modules["__main__"] = main
    sys.argv = [entrypoint]


def _exc_message(exc):
    if isinstance(exc, SystemExit):
        return "SystemExit(%r)" % (exc.code,)
    return str(exc)


def reward_of(value):
    """A float, a dict of floats, or None when the value is neither kind of reward."""
    if type(value) in (float, int, bool):  # the common case, without importing numbers
        return float(value)
    import numbers

    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict) and all(isinstance(v, numbers.Real) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    return None


def to_result(value, max_info_bytes, secrets=()):
    """Split a return value into reward and extra info (as JSON text, under ``info_json``);
    leave validation to the parent. ``secrets``: no cut may keep a part of one."""
    extra = None
    if isinstance(value, tuple) and len(value) == 2:
        value, extra = value
    fields = {"reward": reward_of(value)}
    if fields["reward"] is None:
        fields["reward_type"] = type(value).__name__
        forms = list(secrets) + [repr(s)[1:-1] for s in secrets]
        fields["reward_repr"] = cut(repr(value), 200, forms)
    if extra is None:
        fields["info"] = None
    else:
        import json  # the agent's own data: json's exact rules (keys, NaN, default=repr)

        text = json.dumps(extra, default=repr)
        if len(text) > max_info_bytes:
            preview = cut(text, 4096, [json.dumps(s)[1:-1] for s in secrets])
            summary = {"truncated": True, "bytes": len(text), "preview": preview}
            text = json.dumps(summary)
        fields["info_json"] = text
    return fields


def cut(text, limit, secrets):
    """``text[:limit]``, ended before a secret the cut would split: the parent masks whole
    secrets, never the half of one."""
    end = limit
    for secret in secrets:
        if secret:
            start = text.find(secret, max(0, limit - len(secret) + 1))
            if 0 <= start < end:
                end = start
    return text[:end]


# --- the supervisor ---------------------------------------------------------------------------


def process_table():
    """Map pid -> (ppid, state) for every process, from /proc; empty where there is no /proc."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        stat = read_stat("/proc/%s/stat" % name)
        if stat is None:
            continue
        # The command name may hold spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(b")") + 2 :].split()
        table[int(name)] = (int(rest[1]), rest[0].decode())
    return table


def read_stat(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def has_live_thread(pid):
    """Whether a thread of ``pid`` can still run. A process whose main thread exited
    (``pthread_exit``) reads as a zombie while its other threads run on."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return False
    for tid in tids:
        stat = read_stat("/proc/%d/task/%s/stat" % (pid, tid))
        if stat is not None and stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in b"ZXx":
            return True
    return False


def live_descendants(root):
    table = process_table()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(root, ()))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, ()))
        if table[pid][1] not in "ZX" or has_live_thread(pid):
            found.append(pid)
    return found


def reap(worker_pid, status):
    """Reap every exited child. Returns the worker's (wait status, CPU seconds) once known, and
    whether no child at all is left."""
    while True:
        try:
            pid, code, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return status, True
        if pid == 0:
            return status, False
        if pid == worker_pid:
            status = (code, usage.ru_utime + usage.ru_stime)


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# After SIGKILL, how long the supervisor waits for its tree to be gone before it leaves the rest
# to the parent's sweep, or, as PID 1 of a namespace, to the kernel (seconds).
KILL_WAIT = 5.0


def kill_tree(worker_pid, status, grace, reaper, parent_fd=None):
    """SIGTERM+SIGCONT every descendant, SIGKILL what is left after ``grace`` seconds, and reap
    everything; at most ``grace`` + KILL_WAIT seconds, and with the parent's pipe at EOF at most
    PARENT_GONE_GRACE + KILL_WAIT. Returns (number of processes signalled, worker's status)."""
    status, clear = reap(worker_pid, status)
    if clear and reaper:
        # Every orphan below a subreaper (or PID 1) is re-parented to it, with its exit signal
        # reset to SIGCHLD, so a reaper that wait4() finds childless has no descendants at all:
        # no need to read /proc.
        return 0, status
    me = os.getpid()
    victims = set()
    end = time.monotonic() + grace
    poller = None
    if parent_fd is not None:
        poller = select.poll()
        poller.register(parent_fd, select.POLLIN)
    delay = 0.002
    while True:
        # Reap the dead too: an unreaped zombie's own children would be handed to init.
        status, clear = reap(worker_pid, status)
        live = live_descendants(me)
        now = time.monotonic()
        if not live and clear:
            return len(victims), status
        if now > end + KILL_WAIT:
            # Something is stuck in the kernel (D state), or a child cannot be reaped: the
            # parent's sweep (or the namespace's end) takes over.
            return len(victims), status
        fresh = [pid for pid in live if pid not in victims]
        victims.update(fresh)
        if now < end:
            signal_all(fresh, signal.SIGTERM)
            signal_all(fresh, signal.SIGCONT)  # after: a stopped process meets SIGTERM pending
        else:
            signal_all(live, signal.SIGKILL)
        if poller is None:
            time.sleep(delay)
        else:
            for _ in poller.poll(delay * 1000):
                if parent_eof(parent_fd):
                    poller = None
                    end = min(end, time.monotonic() + PARENT_GONE_GRACE)
        delay = min(delay * 2, 0.02)


def parent_eof(fd):
    """Read what the parent sent (a cancel request, ignored this late); True at EOF."""
    try:
        return not os.read(fd, 4096)
    except BlockingIOError:
        return False
    except OSError:
        return True


def supervise(hs, channel, parent_fd, worker_pid, wake_fd, exit_fd, flags, reaper, pending):
    """Wait for the worker to exit (bounded by ``exit_grace`` once it said its final frame is
    out), for the deadline, a cancel request, SIGTERM or the parent's death; at an early end
    cancel the agent first (``cancel_grace``); then kill the tree and send ``done``."""
    deadline = time.monotonic() + float(hs.get("deadline", 1e9))
    grace = float(hs.get("kill_grace", 5.0))
    poller = select.poll()
    poller.register(parent_fd, select.POLLIN)
    poller.register(wake_fd, select.POLLIN)
    poller.register(exit_fd, select.POLLIN)
    status, why = None, "cancelled" if CANCEL in pending else "exited"
    exit_by = None  # when the worker's normal exit must be over (monotonic)
    exiting = False  # the worker's final frame is out: nothing left to cancel
    while why == "exited":
        status, _ = reap(worker_pid, status)
        if status is not None:
            break
        if flags.get("terminated"):
            why, grace = "terminated", min(grace, PARENT_GONE_GRACE)
            break
        now = time.monotonic()
        if exit_by is not None and now >= exit_by:
            sys.stderr.write(
                "isolate shim: the agent's exit took longer than exit_grace (%g s): killed; "
                "its result stands\n" % float(hs.get("exit_grace", 10.0))
            )
            signal_all([worker_pid], signal.SIGKILL)
            exit_by = None
        remaining = deadline - now
        if remaining <= 0 and not exiting:
            # Once the final frame is out, the result stands: exit_grace bounds the rest.
            why = "deadline"
            break
        if exiting:
            remaining = 3600.0  # past the deadline too: exit_by decides
        if exit_by is not None:
            remaining = min(remaining, exit_by - now)
        for fd, _ in poller.poll(min(remaining, 3600.0) * 1000):
            if fd == wake_fd:
                try:
                    os.read(wake_fd, 4096)
                except BlockingIOError:
                    pass
            elif fd == exit_fd:
                if not os.read(exit_fd, 16):
                    poller.unregister(exit_fd)  # EOF: the worker is gone
                elif not exiting:
                    exiting, exit_by = True, time.monotonic() + float(hs.get("exit_grace", 10.0))
            else:
                data = os.read(parent_fd, 4096)
                if not data:
                    why, grace = "parent gone", min(grace, PARENT_GONE_GRACE)
                    poller.unregister(parent_fd)
                elif CANCEL in data:
                    why = "cancelled"
    cancel_grace = float(hs.get("cancel_grace", 0.0))
    if why not in ("exited", "terminated") and not exiting and cancel_grace > 0:
        # Cancel first: the agent releases its sandboxes in its own finally: blocks.
        status, _ = reap(worker_pid, status)
        if status is None:
            part = load_part("cancel")
            status, how = part.cancel_worker(worker_pid, status, cancel_grace, wake_fd, flags, reap)
            if why != "parent gone":
                try:
                    channel.send("cleanup", how=how)
                except OSError:
                    pass
    watch = None if why == "parent gone" else parent_fd
    killed, status = kill_tree(worker_pid, status, grace, reaper, watch)
    done = {"why": why, "killed": killed, "exit_code": None, "signal": None}
    if status is not None:
        status, done["cpu_s"] = status
        if os.WIFSIGNALED(status):
            done["signal"] = os.WTERMSIG(status)
        else:
            done["exit_code"] = os.WEXITSTATUS(status)
    if why == "parent gone":
        os._exit(0)  # nobody to report to; skip the interpreter shutdown
    try:
        channel.send("done", **done)
    except OSError:
        pass
    # The report is out: skip interpreter finalisation, which costs every episode ~20 ms.
    flush_std_streams()
    os._exit(0 if why == "exited" else 3)


def helpers():
    """What the template and probe parts use of the shim: a template's wall, and a probe's, is
    an episode's."""
    import types

    names = (
        "main load_entrypoint process_table live_descendants signal_all layers_of unshare_pidns "
        "become_init set_subreaper join_cgroups enter_landlock harden load_part c_call"
    )
    return types.SimpleNamespace(**{name: globals()[name] for name in names.split()})


def main():
    if sys.argv[1:2] == ["--probe-pidns"]:
        return load_part("probe").pidns(helpers(), sys.argv[2:] == ["userns"])
    if sys.argv[1:] == ["--probe-landlock"]:
        return load_part("probe").landlock(helpers())
    if sys.argv[1:] == ["--probe-net"]:
        return load_part("net").probe(c_call, map_own_ids, capability_sets)
    if sys.argv[1:2] == ["--template"]:
        # A preloaded template (isolate preload=True): each of its forks calls main() again.
        return load_part("template").serve(helpers())
    if sys.platform.startswith("linux"):
        # Before anything else: nothing the agent starts (same user) may read or write this
        # process's memory, ptrace it or take its fds, nor those of its forks (the relay, PID
        # 1 and the worker inherit it; an exec does not).
        c_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    frames_fd = os.dup(1)  # private and close-on-exec: no exec'd process can write frames
    os.dup2(2, 1)  # fd 1 now goes to the log, for us, the agent and every subprocess
    for stream in (sys.stdout, sys.stderr):
        # Explicit, so nothing the agent printed is lost on a crash, whatever the env says.
        stream.reconfigure(line_buffering=True, write_through=True)
    parent_fd = os.dup(0)
    raw, pending = read_handshake(parent_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if raw is None:
        sys.stderr.write("isolate shim: no handshake from the parent\n")
        return 2
    try:
        hs = json_loads(raw.decode("utf-8"))
        nonce = hs["nonce"]
        if not isinstance(nonce, str):
            raise TypeError("nonce")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        sys.stderr.write("isolate shim: unreadable handshake (%s)\n" % type(exc).__name__)
        return 2
    del raw
    channel = Channel(frames_fd, nonce)
    subreaper = set_subreaper()
    level = hs.get("containment", "session")
    channel.send(
        "hello",
        protocol=PROTOCOL_VERSION,
        pid=os.getpid(),
        python=".".join(map(str, sys.version_info[:3])),
        subreaper=subreaper,
        containment=level if is_containment(level) else None,
    )
    if type(hs.get("protocol")) is not int or hs["protocol"] != PROTOCOL_VERSION:
        return 2
    problem, kind = check_handshake(hs), "HandshakeError"
    if problem is None:
        problem, kind = contain(hs), "ContainmentError"
    if problem is not None:
        sys.stderr.write("isolate shim: %s\n" % problem)
        channel.send("error", kind="setup", type=kind, message=problem)
        return 2

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    exit_r, exit_w = os.pipe()  # the worker writes a byte once its final frame is out
    flags = {}
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: flags.update(terminated=True))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal is not our business
    # SIGINT is how the worker is cancelled; the supervisor never takes it. Blocked before
    # the fork, so that one sent before the worker has set its handler waits for it.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])

    supervisor = os.getpid()
    if sys.platform.startswith("linux"):
        # What the worker's hardening needs, loaded once here, not in every fork's fresh pages.
        load_part("seccomp")
        for name in ("syscall", "capset"):
            c_call_function(name)
    # The shim's own objects, never collected in the worker: its collector (and the final
    # collections of its normal exit) would write to each one's header, copying every page of
    # the supervisor's heap it shares. The agent's objects, all made after the fork, are
    # collected as usual.
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if sys.platform.startswith("linux"):
                # Should the supervisor be SIGKILLed (say by a cluster agent killing the parent's
                # children), the worker dies with it instead of running on under init.
                c_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != supervisor:
                    os._exit(1)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            for fd in (wake_r, wake_w, parent_fd, exit_r):
                os.close(fd)
            code = worker(hs, channel)
            os.write(exit_w, b"x")
        except BaseException:
            import traceback

            traceback.print_exc()  # a bug of the shim itself: leave a trace in the log
            os._exit(code)
        # The final frame is out. The supervisor bounds what follows by exit_grace.
        leave_worker(code)
    os.close(exit_w)
    hs.pop("secrets", None)
    hs.pop("secret_env", None)
    hs.pop("data", None)
    reaper = subreaper or supervisor == 1  # PID 1 of a namespace needs no prctl
    return supervise(hs, channel, parent_fd, pid, wake_r, exit_r, flags, reaper, pending)


if __name__ == "__main__":
    sys.exit(main())
