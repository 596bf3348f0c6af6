"""``python -m isolate``: the same command line as ``isolate``."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
