"""A parked fork of a preloaded template (``shim_template.py``): it waits for its episode on
its hand-over socket, then runs shim.main(), the code of a fresh start. Loaded by the template
before its first fork, with ``load_part("parked")``. Standard library only, Python 3.9+.
"""

import os
import signal
import sys

# Loaded by shim.py, under its private name, before any part.
import _isolate_shim_wire as wire

shim = sys.modules["_isolate_shim"]

EPISODE_ENV = wire.EPISODE_ENV
receive = wire.receive_message


def park(hand, own, shim_main, random_state):
    """In the fork: a session of its own, then the hand-over; its exit code (0 at EOF)."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for item in own:
        if isinstance(item, int):
            os.close(item)
        else:
            item.close()
    try:
        message, fds = receive(hand)
    except (OSError, ValueError):
        message, fds = None, []
    hand.close()
    if message is None or message.get("t") != "episode" or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return 0 if message is None else 1
    return episode(message, fds, shim_main, random_state)


def episode(message, pipes, shim_main, random_state):
    """In a parked fork, handed its episode: become a fresh start's shim, run shim.main()."""
    channel, stderr = pipes
    for target, fd in ((0, channel), (1, channel), (2, stderr)):
        os.dup2(fd, target)
    for fd in pipes:
        if fd > 2:
            os.close(fd)
    os.environ[EPISODE_ENV] = str(message.get("episode_id"))  # what its processes inherit
    random = sys.modules.get("random")
    if random is not None and hash(random.getstate()) == random_state:
        random.seed()  # Python reseeds at fork; should that ever not happen, we do
    sys.argv[1:] = []
    code = shim_main()
    return code if isinstance(code, int) else 0
