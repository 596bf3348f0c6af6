"""The ``isolate`` command line: ``run``, ``batch``, ``doctor``, ``demo``."""

from .main import main

__all__ = ["main"]
