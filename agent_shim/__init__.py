"""The child side of isolate, started by file path under the agent's own interpreter.

Standard library only. Importing this package does nothing; ``shim.py`` is the program, and
``boot.py`` how the parent starts it.
"""
