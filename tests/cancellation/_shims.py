"""Fake shims the cancellation tests run in place of the real one: ``TERM_NOTING_SHIM`` notes
SIGTERM and carries on; ``SILENT_SHIM`` never says hello, so it holds its place at the start
gate (``test_template_pool`` uses it too)."""

from __future__ import annotations

# A shim that says hello, then notes SIGTERM in a file and carries on: the parent's teardown
# has to wait out the whole grace period for it (the real shim's supervisor cuts its own
# subtree's grace short when it is terminated itself).
TERM_NOTING_SHIM = """\
import json, os, signal, sys, time
hs = json.loads(sys.stdin.buffer.readline())
pid_dir = os.environ["PID_DIR"]
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(pid_dir, "term"), "w").close())
hello = {"t": "hello", "nonce": hs["nonce"], "protocol": 1, "pid": os.getpid(),
         "python": "3", "subreaper": False}
sys.stdout.write(json.dumps(hello) + "\\n")
sys.stdout.flush()
while True:
    time.sleep(1)
"""


# A shim that reads its handshake and never says hello: it holds its place at the start gate.
SILENT_SHIM = "import sys, time\nsys.stdin.buffer.readline()\ntime.sleep(300)\n"
