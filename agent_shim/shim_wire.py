"""What the two sides of isolate agree on, in one place: the protocol's version, the bytes of a
cancel request, the variable that tags an episode's processes, the containment grammar, the
limits of an error's text, and the codec of the template's control socket.

The shim loads this file with ``load_part("wire")``, the parent imports it as
``agent_shim.shim_wire``. Standard library only, Python 3.9+; importing it does nothing.
"""

import os

TYPE_CHECKING = False  # typing's would cost every start an import; type checkers know it
if TYPE_CHECKING:
    import socket
    from typing import Any, Mapping, Sequence

# socket, array and json are imported where used: every episode's shim loads this file, and
# only a template's fork uses the codec.

PROTOCOL_VERSION = 1
#: What the parent writes on the shim's stdin, after the handshake, to cancel the episode.
CANCEL = b"cancel\n"
#: Set in every process of an episode, to its id (the caller's, which two episodes may share).
EPISODE_ENV = "ISOLATE_EPISODE_ID"
#: Set in every process of an episode, to a random tag of its own: the parent's sweep finds
#: them by it, and never another episode's.
EPISODE_TAG_ENV = "ISOLATE_EPISODE_TAG"
#: The variables isolate sets in every process of an episode: neither the spec nor the
#: caller's secret_env may set them, and they vary per episode.
EPISODE_VARS = (EPISODE_ENV, EPISODE_TAG_ENV)
#: Containment layers, strongest first; a combination joins them with ``+`` in this order.
LAYERS = ("cgroup", "pidns", "landlock")
#: An error frame's message and traceback are cut to these many characters.
MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS = 64 * 1024, 256 * 1024
#: One message on a template's control socket (bytes), and the fds it may carry.
MAX_CONTROL_BYTES, MAX_CONTROL_FDS = 1 << 16, 4


def canonical_containment(value: object) -> "str | None":
    """``"session"``, or the layers ``value`` joins by ``+`` in the order of LAYERS, each once;
    None when it is neither. ``"auto"`` is the parent's to resolve, never on the wire."""
    if value == "session":
        return value
    parts = value.split("+") if isinstance(value, str) else ()
    if not parts or len(set(parts)) != len(parts) or not all(p in LAYERS for p in parts):
        return None
    return "+".join(layer for layer in LAYERS if layer in parts)


def layers(containment: str) -> "list[str]":
    """The layers of a canonical containment value, in the order of LAYERS: ``[]`` for
    ``"session"``, ``["cgroup", "pidns"]`` for ``"cgroup+pidns"``."""
    return [] if containment == "session" else containment.split("+")


def send_message(
    sock: "socket.socket", message: "Mapping[str, object]", fds: "Sequence[int]" = ()
) -> None:
    """One JSON message on a SOCK_SEQPACKET socket, with ``fds`` attached (SCM_RIGHTS)."""
    import array
    import json
    import socket

    data = json.dumps(message).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError("a control message of %d bytes: pass what is larger as a file" % len(data))
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendmsg([data])


def receive_message(sock: "socket.socket") -> "tuple[dict[str, Any] | None, list[int]]":
    """One message and the fds it carried: (None, []) at EOF; (None, fds) for a message that
    is not a JSON object. ValueError for one that is not JSON."""
    import array
    import json
    import socket

    size = array.array("i").itemsize
    data, ancillary, flags, _ = sock.recvmsg(
        MAX_CONTROL_BYTES + 1, socket.CMSG_SPACE(MAX_CONTROL_FDS * size)
    )
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % size])
    if len(data) > MAX_CONTROL_BYTES or flags & socket.MSG_TRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError("a control message longer than %d bytes" % MAX_CONTROL_BYTES)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        message = json.loads(data.decode())
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return (message if isinstance(message, dict) else None), list(fds)


def json_file(value: object) -> int:
    """An fd to read ``value`` back from as JSON (a memfd, from its start): for what may be
    larger than a control message. The receiver closes it."""
    import json
    import tempfile

    data = json.dumps(value).encode()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("isolate-message", os.MFD_CLOEXEC)
    else:
        fd, path = tempfile.mkstemp()
        os.unlink(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_json_file(fd: int) -> object:
    """What :func:`json_file` wrote, read from ``fd``, which it closes. ValueError if it is not
    JSON."""
    import json

    chunks = []
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks).decode())
