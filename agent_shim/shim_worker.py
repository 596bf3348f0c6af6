"""The worker: the episode's process that becomes the agent.

Forked by the shim's supervisor. It enters what contains it (Landlock, rlimits, the secrets in
``os.environ``, the network namespace, the sandbox, the syscall filter, fewer capabilities),
imports the entrypoint, calls it, and sends one ``result`` or ``error`` frame. Loaded with
``load_part("worker")`` before the fork, so that a template's forks share its pages. Standard
library only, Python 3.9+.
"""

import gc
import os
import sys
from errno import EINVAL

shim = sys.modules["_isolate_shim"]
signal = shim.signal

# What a root agent keeps: file ownership and permissions, setuid and setgid, kill, low-port sockets
# (in a network namespace of its own), chroot, audit writes. Docker keeps raw sockets, mknod and
# file capabilities too, in a container with a network and a /dev of its own; here the episode may
# share the machine's network namespace (a raw socket reads every process's loopback traffic) and
# its writable paths (a device node made there opens the machine's disk; a file capability outlives
# the episode), so those go. Every other capability reaches past the episode. Bits of capability.h.
KEPT_CAPABILITIES = (0, 1, 3, 4, 5, 6, 7, 10, 18, 29)
# Kept only in a network namespace of the episode's own: in the machine's, a port below 1024
# the agent binds is a service of the machine's taken over (80, 443, 53).
CAP_NET_BIND_SERVICE = 10
CAP_SETPCAP = 8
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def run(hs, channel, supervisor_pid, supervisor):
    """The worker's life, at once after the fork: its exit code after the final frame, or the
    shim's own failure with a traceback in the log. Never returns. ``supervisor`` None: a
    template's fork that is its own worker, supervised by the parent (shim_parked.py)."""
    code = 1
    try:
        if sys.platform.startswith("linux") and supervisor is not None:
            # Should the supervisor be SIGKILLed (say by a cluster agent killing the parent's
            # children), the worker dies with it instead of running on under init.
            shim.c_call("prctl", shim.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != supervisor_pid:
                os._exit(1)
        exit_w = supervisor.as_worker() if supervisor is not None else None
        code = worker(hs, channel)
        if exit_w is not None:
            os.write(exit_w, b"x")
    except BaseException:
        import traceback

        traceback.print_exc()  # a bug of the shim itself: leave a trace in the log
        shim.leave(code)
    # The final frame is out. The supervisor bounds what follows by exit_grace. As PID 1 of
    # this PID namespace it need not wait for this exit: its own reaps what is left of this
    # process. So it is told the exit status, and goes on while the kernel tears this down.
    tell = exit_w if supervisor_pid == 1 else None
    leave_worker(code, tell)


def worker(hs, channel):
    """Enter what contains the agent, import and call the entrypoint; exit code 0 after a
    result, else the error's code."""
    secret_env = enter(hs, channel)
    if secret_env is None:
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
            value = shim.load_part("cancel").run_async(value)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are the agent's too
        if isinstance(exc, MemoryError):
            take_report_room(hs)
        text = format_exc()
        sys.stderr.write(text)  # the log keeps it too
        code = 1
        if isinstance(exc, SystemExit):
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        fields = report(_exc_message(exc), text, list(secrets.values()) + list(secret_env.values()))
        # Raised by the call itself, not from inside the entrypoint: its arguments do not fit.
        if isinstance(exc, TypeError) and _raised_here(exc):
            fields["at_call"] = True
        channel.send("error", kind="agent", type=type(exc).__name__[:200], **fields)
        return code & 0xFF
    limit = hs.get("max_info_bytes", 1 << 20)
    values = list(secrets.values()) + list(secret_env.values())
    try:
        fields = to_result(value, limit, values)
    except Exception as exc:  # the agent's value raised: its __repr__, __float__, a cycle
        text = format_exc()
        sys.stderr.write(text)
        message = "the entrypoint's return value cannot be sent back: %s: %s" % (
            type(exc).__name__,
            _exc_message(exc),
        )
        fields = report(message, text, values)
        channel.send("error", kind="agent", type=type(exc).__name__[:200], **fields)
        return 1
    channel.send("result", **fields)
    return 0


def enter(hs, channel):
    """Everything before the agent's import: Landlock, the rlimits, the secrets in
    ``os.environ``, the sandbox, the syscall filter and capabilities. The secret_env it set,
    or None after sending the error frame."""
    # A template's forks share its PID namespace: each worker gets a domain of its own, so that
    # no episode can signal or trace another (``scoped``).
    if "landlock" in shim.layers_of(hs) or hs.get("scoped"):
        problem = enter_landlock()
        if problem is not None:
            channel.send("error", kind="setup", type="ContainmentError", message=problem)
            return None
    rlimits = sorted(hs.get("rlimits", {}).items())
    if rlimits:
        import resource
    for name, (soft, hard) in rlimits:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (OSError, ValueError) as exc:
            message = "cannot set %s to %s: %s" % (name, (soft, hard), exc)
            channel.send("error", kind="setup", type="LimitError", message=message)
            return None
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
    if sandbox is not None and not enter_sandbox(sandbox, channel, bool(hs.get("forked"))):
        return None
    if sys.platform.startswith("linux"):
        network = sandbox is not None and sandbox.get("network") is not None
        problem = harden(own_network=network)
        if problem is not None:
            channel.send("error", kind="setup", type="ContainmentError", message=problem)
            return None
    return secret_env


def enter_landlock():
    """Put this process (the worker, before anything of the agent runs) into a new Landlock
    domain scoped for signals and abstract unix sockets, handling no file or port access. The
    supervisor stays outside: the agent cannot signal it either. A problem or None."""
    landlock = shim.load_part("landlock")
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


def enter_sandbox(sandbox, channel, forked=False):
    """The network namespace and the file-system sandbox; False after the error frame.
    ``forked``: a template's fork, which made its network namespace already."""
    missing = []
    network = sandbox.get("network")
    if network is not None:
        part = shim.load_part("net")
        problem = part.enter(network, channel, forked)
        if problem is not None:
            missing.append("network isolation: " + problem)
    # Last before the agent's import: the shim's own parts are loaded by now.
    missing += shim.load_part("sandbox").enter(sandbox)
    if missing and not sandbox.get("best_effort"):
        message = "sandbox: cannot enforce " + "; ".join(missing)
        channel.send("error", kind="setup", type="SandboxError", message=message)
        return False
    channel.send("sandbox", missing=missing)
    return True


def harden(unshare=0, own_network=False):
    """The last step before the agent's code: a syscall filter (mounts, namespaces, other
    processes' memory and fds, kernel keys and modules...; shim_seccomp.py), then every
    capability that reaches past the episode dropped from all five sets, so that nothing the
    agent execs gets one back; the worker stays not dumpable. A problem, or None. A kernel
    without seccomp is said in the log, and the rest still holds. ``unshare``: the flags of
    ``unshare`` the filter allows (a template's importer, for its forks); ``own_network``: in a
    network namespace of the episode's own (a sandbox's network), where it may bind ports
    below 1024."""
    problem = shim.load_part("seccomp").install(unshare)
    if problem is not None:
        sys.stderr.write("isolate shim: no syscall filter: %s\n" % problem)
    problem = drop_capabilities(own_network)
    # The kernel resets it on some credential changes (commit_creds): once more, last.
    shim.c_call("prctl", shim.PR_SET_DUMPABLE, 0, 0, 0, 0)
    return problem


def drop_capabilities(own_network=False):
    """Keep at most :func:`kept` in every set. The bounding set needs CAP_SETPCAP, so it goes
    first, that one last. A problem or None."""
    keep = kept(own_network)
    sets = capability_sets()
    shim.c_call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    problem = drop_bounding(keep, sets)
    if problem is not None:
        return problem
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
    result, errno = shim.c_call("capset", header, data)
    if result != 0:
        return "cannot drop capabilities: %s" % os.strerror(errno)
    return None


def kept(own_network):
    """The capabilities an agent keeps, as a mask: KEPT_CAPABILITIES for root (NET_BIND_SERVICE
    only with ``own_network``), none for any other user (in its user namespace it holds them
    all)."""
    if os.getuid() != 0:
        return 0
    return sum(1 << cap for cap in KEPT_CAPABILITIES if own_network or cap != CAP_NET_BIND_SERVICE)


def drop_bounding(keep, sets=None):
    """Drop from the bounding set every capability not in the mask ``keep``: none of them can
    come back, not even through an exec. A problem or None. Without CAP_SETPCAP the set
    stays; no_new_privs (set with the syscall filter for such a process) keeps exec from
    granting anything from it. ``sets``: :func:`capability_sets`, if read already."""
    sets = capability_sets() if sets is None else sets
    bounding = sets.get("CapBnd", 0) & ~keep
    if bounding and sets.get("CapEff", 0) >> CAP_SETPCAP & 1:
        for cap in range(64):
            if bounding >> cap & 1:
                result, errno = shim.c_call("prctl", PR_CAPBSET_DROP, cap, 0, 0, 0)
                if result != 0 and errno != EINVAL:  # a capability this kernel lacks
                    return "cannot drop capability %d: %s" % (cap, os.strerror(errno))
    return None


def capability_sets():
    """This process's capability sets from /proc/self/status: {"CapEff": int, ...}."""
    with open("/proc/self/status") as f:
        return {line[:6]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}


# What of an error the parent keeps (characters): the start of its message, the end of its
# traceback (where it was raised). Cut here, so that the frame fits the parent's cap.


def report(message, traceback, secrets):
    """An error frame's message and traceback, cut to what the parent keeps; never through a
    secret (the log has both whole)."""
    room = 64  # for the note of what was cut: the whole stays within the parent's limit
    if len(message) > shim.MAX_MESSAGE_CHARS:
        cut_at = len(cut(message, shim.MAX_MESSAGE_CHARS - room, secrets))
        message = "%s [... %d more characters]" % (message[:cut_at], len(message) - cut_at)
    if len(traceback) > shim.MAX_TRACEBACK_CHARS:
        start = len(traceback) - shim.MAX_TRACEBACK_CHARS + room
        for secret in secrets:
            found = traceback.find(secret, max(0, start - len(secret) + 1)) if secret else -1
            if 0 <= found < start:
                start = found + len(secret)  # it spans the cut: keep none of it
        traceback = "[%d characters cut ...]\n%s" % (start, traceback[start:])
    return {"message": message, "traceback": traceback}


def leave_worker(code, tell=None):
    """The worker's exit after its final frame: what plain python's exit does for a program,
    without tearing down every module. Non-daemon threads are joined, atexit hooks run
    (logging.shutdown, weakref.finalize: TemporaryDirectory, multiprocessing's), cyclic garbage
    is collected with its finalisers, files still open are closed (so flushed), then stdout and
    stderr; then os._exit. CPython's teardown would also deallocate every module's objects: for
    an agent that imported litellm, 110-180 ms of CPU, and in a template's fork a copy of each
    page it touches. Python does not promise finalisers of objects alive at exit anyway.
    ``tell``: the supervisor's exit pipe, when it is PID 1 of this namespace: the last thing
    before os._exit is the line ``exit CODE CPU_S`` on it (see the supervisor's ``told``)."""
    # First what the agent printed: a thread that never ends may get this exit killed.
    shim.flush_std_streams()
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # what the interpreter's exit does first
    import atexit

    atexit._run_exitfuncs()
    gc.collect()
    close_open_files()
    exit_worker(code, tell)


def exit_worker(code, tell=None):
    """Flush stdout and stderr and end this process at once; ``tell``: the line ``exit CODE
    CPU_S`` on it first."""
    shim.flush_std_streams()  # first: once told, the supervisor may end the namespace
    if tell is not None:
        times = os.times()  # this process's CPU and its reaped children's, as wait4 counts it
        try:
            os.write(tell, b"exit %d %r\n" % (code & 0xFF, sum(times[:4])))
        except OSError:
            pass  # the supervisor is gone: so is the namespace
    os._exit(code)


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


def _raised_here(exc):
    """Whether ``exc`` was raised in the worker's own frame (the call of the entrypoint binding
    its arguments), with no frame of the entrypoint on its traceback. A coroutine's arguments
    are bound at the call too."""
    tb = exc.__traceback__
    return tb is not None and tb.tb_next is None and tb.tb_frame.f_code is worker.__code__


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
