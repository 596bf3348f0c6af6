"""PID 1 of a preloaded template's PID namespace (``shim_template.py``), and how a template's
process tells the parent the importer's wait status (on LIFE).

Loaded by the template with ``load_part("init")``. Standard library only, Python 3.9+.
"""

import os
import socket
import sys

shim = sys.modules["_isolate_shim"]
send = shim.wire.send_message


def tell(life, status):
    """Send the importer's wait status to the parent (on LIFE)."""
    if life is not None:
        try:
            send(socket.socket(fileno=os.dup(life)), {"t": "exit", "status": status})
        except OSError:
            pass  # the parent is gone


def init(importer, life):
    """PID 1 of the template's namespace: report the importer's end, reap, and exit once no
    process is left. Never returns."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == importer:
            tell(life, status)
