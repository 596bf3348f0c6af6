"""The core: spec, outcome, errors, protocol, launcher, containment, tree, env, redact, tail.

Nothing here knows about the command line or AReaL; ``isolate/__init__.py`` re-exports the
public part.
"""
