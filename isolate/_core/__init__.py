"""The core: ``network``, ``model`` (the spec, the outcome, the errors), ``system``,
``containment`` (the wall), ``templates`` and ``episode`` (``run_episode`` and its stages),
each importing only the ones before it in this list.

Nothing here knows about the command line or AReaL; ``isolate/__init__.py`` re-exports the
public part.
"""
