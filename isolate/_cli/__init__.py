"""The ``isolate`` command line: ``run``, ``batch``, ``doctor``, ``demo``, ``scripted-llm``."""

from .main import main

__all__ = ["main"]
