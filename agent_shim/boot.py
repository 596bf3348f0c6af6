"""How the parent starts the shim: ``<python> -I agent_shim/boot.py``.

Python compiles the script it is given from source on every start, but imports a module from
its cached bytecode (``__pycache__``). Compiling shim.py costs each episode about 5 ms; this
file is all that is compiled per start. Running shim.py directly works the same, only slower.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import shim
finally:
    del sys.path[0]
# The agent may have a module called shim of its own.
del sys.modules["shim"]
# Under any other name (say multiprocessing's __mp_main__) this file must not run an episode.
if __name__ == "__main__":
    sys.exit(shim.main())
