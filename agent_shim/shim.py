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
5. Check the rest of the handshake, then contain (``shim_supervisor.contain``): join the
   episode's cgroups before creating any process; with ``pidns``, fork PID 1 of a new PID
   namespace (with a private /proc), which carries on as the supervisor while this process
   only relays SIGTERM and its exit; a privileged parent starts the shim as PID 1 of a
   namespace of its own (``pid1``), which needs no relay.
6. Fork the worker (``shim_worker.py``; a parked fork of a template forked it ahead and hands it
   the handshake here: ``shim_parked.py``), which enters its Landlock domain (with ``landlock``:
   from then on nothing it runs can signal or ptrace a process outside), sets the episode's
   rlimits, imports and calls the entrypoint and writes a ``result`` or ``error`` frame. The
   supervisor (``shim_supervisor.py``) reaps orphans, enforces its own deadline, watches the
   parent pipe, and when the worker is gone kills every survivor and sends ``done``.

This file is the short main and what its parts share: the frame channel, JSON, the C calls
(``c_call``), the signal module, the kernel's numbers more than one part uses, the exit.

The parts are wired one way: a part takes the shim at load, ``shim = sys.modules["_isolate_shim"]``
(registered before any part is loaded), and from it all it needs: ``shim.c_call``,
``shim.signal``, ``shim.wire``, ``shim.load_part`` for the other parts, ``shim.PR_*`` and
``shim.CLONE_*``. No part takes the shim's helpers as arguments, imports another by its private
name or imports signal itself. Why this way: the parts run only in the shim's process and use
many of its helpers, so a lookup at load keeps their signatures about what they do, not about
plumbing; boot.py and ``load_part`` stay plain (a file executed, nothing injected); and a part
loaded outside the shim fails at once, loudly. A number only one part uses stays in it. Two
files take nothing from the shim, because the parent imports them too: shim_wire.py (the
protocol's constants, shared with the parent) and shim_landlock.py (the parent asks it the
kernel's ABI), which calls through the shim's ``c_call`` where the shim loaded it, else ctypes.

Frames are single JSON lines carrying the handshake's nonce. See docs/protocol.md.
"""

import gc
import os
import sys

try:
    # The C module that signal.py wraps in enums; it is loaded at start-up already, while
    # importing signal.py costs 0.6 ms.
    import _signal as signal  # noqa: F401 - the parts' signal module: shim.signal
except ImportError:
    import signal  # noqa: F401

# Every episode pays for the shim's imports on its launch path. So asyncio (~40 ms), ctypes,
# json, numbers, resource and traceback are imported where used, and re not at all.

HERE = os.path.dirname(os.path.abspath(__file__))

MAX_HANDSHAKE_BYTES = 512 * 1024 * 1024
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x02000000, 0x04000000, 0x08000000
CLONE_NEWTIME, CLONE_NEWNET, PR_SET_NO_NEW_PRIVS = 0x80, 0x40000000, 38


def load_part(name):
    """Import the child-side part ``agent_shim/shim_<name>.py`` as ``_isolate_shim_<name>``.

    Parts are loaded on demand, from their cached bytecode, under a private name only: the agent
    may have a module called ``shim_<name>`` of its own, and it must find its own. Loaded by
    file, not through sys.path: no directory is searched.
    """
    private = "_isolate_shim_" + name
    module = sys.modules.get(private)
    if module is not None:
        return module
    try:  # importlib's own frozen core, loaded at every start (importlib.util is not)
        from _frozen_importlib import module_from_spec
        from _frozen_importlib_external import spec_from_file_location
    except ImportError:  # not CPython
        from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location(private, os.path.join(HERE, "shim_%s.py" % name))
    module = module_from_spec(spec)
    sys.modules[private] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private]
        raise
    return module


# boot.py removes the public name ``shim``: the agent may have a module of that name.
sys.modules["_isolate_shim"] = sys.modules[__name__]

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
        ("pid1", lambda v: v is True),
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
    return wire.layers(hs.get("containment", "session"))


def is_rlimit(name, value):
    import resource

    return (
        name.startswith("RLIMIT_")
        and hasattr(resource, name)
        and isinstance(value, list)
        and len(value) == 2
        and all(type(x) is int and x >= 0 for x in value)
    )


def flush_std_streams():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def leave(code):
    """Flush stdout and stderr, then end this process at once, without the interpreter's
    shutdown: how every process of the shim ends once its work is out."""
    flush_std_streams()
    os._exit(code)


def main(ahead=None, alone=False):
    """``ahead``: in a parked fork of a template, its worker forked ahead; ``alone``: a parked
    fork that is its own worker, supervised by the parent (shim_parked.py)."""
    if sys.argv[1:2] == ["--probe-pidns"]:
        return load_part("probe").pidns(sys.argv[2:] == ["userns"])
    if sys.argv[1:] == ["--probe-landlock"]:
        return load_part("probe").landlock()
    if sys.argv[1:] == ["--probe-net"]:
        return load_part("net").probe()
    if sys.argv[1:2] == ["--template"]:
        # A preloaded template (isolate preload=True): each of its forks calls main() again.
        return load_part("template").serve()
    if sys.platform.startswith("linux"):
        # Before anything else: nothing the agent starts (same user) may read or write this
        # process's memory, ptrace it or take its fds, nor those of its forks (the relay, PID
        # 1 and the worker inherit it; an exec does not).
        c_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    if os.getpid() == 1:
        # Started as PID 1 of a PID namespace (handshake ``pid1``), where no signal reaches a
        # process without a handler for it: until the supervisor takes it, SIGTERM ends this
        # process, as it ends any other shim before its worker exists.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    frames_fd, parent_fd, raw, pending = take_stdio()
    hs = parse_handshake(raw)
    if hs is None:
        return 2
    channel = Channel(frames_fd, hs["nonce"])
    subreaper = False if alone else set_subreaper()  # the agent's process sees its own children
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
    part = load_part("supervisor")
    problem, kind = check_handshake(hs), "HandshakeError"
    if problem is None:
        problem, kind = part.contain(hs), "ContainmentError"
    if problem is not None:
        sys.stderr.write("isolate shim: %s\n" % problem)
        channel.send("error", kind="setup", type=kind, message=problem)
        return 2
    if alone:
        os.close(parent_fd)  # the parent signals this process; it reads nothing more
        load_part("worker").run(hs, channel, None, None)  # exits
    supervisor = part.Supervisor(parent_fd, pending)
    worker = ahead.hand(raw, frames_fd, supervisor.exit_w) if ahead is not None else None
    del raw
    if worker is None:  # none forked ahead, or it is gone
        worker = fork_worker(hs, channel, supervisor)
    for name in ("secrets", "secret_env", "data"):
        hs.pop(name, None)
    reaper = subreaper or os.getpid() == 1  # PID 1 of a namespace needs no prctl
    return supervisor.run(hs, channel, worker, reaper)


def take_stdio():
    """fd 1 kept as the private frames fd, then pointed at the log (stderr); the handshake read
    from a private copy of fd 0, then fd 0 is /dev/null. Returns the frames fd, the parent's
    fd, the handshake as read and what came after it."""
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
    return frames_fd, parent_fd, raw, pending


def parse_handshake(raw):
    """The handshake as a dict with a str nonce; None (said on stderr) when it is not one."""
    if raw is None:
        sys.stderr.write("isolate shim: no handshake from the parent\n")
        return None
    try:
        hs = json_loads(raw.decode("utf-8"))
        if not isinstance(hs["nonce"], str):
            raise TypeError("nonce")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        sys.stderr.write("isolate shim: unreadable handshake (%s)\n" % type(exc).__name__)
        return None
    return hs


def fork_worker(hs, channel, supervisor):
    """Fork the worker, which runs the agent and never returns here; its pid."""
    worker = before_worker_fork()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        worker.run(hs, channel, me, supervisor)  # exits
    return pid


def before_worker_fork():
    """Load what the worker needs before it is forked; the worker part."""
    worker = load_part("worker")
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
    return worker


if __name__ == "__main__":
    sys.exit(main())
