"""The machine as the parent sees it: ``/proc`` readers, the one kill loop (``Reaper``), the
episode's process tree, the shim's path and probes, the child's environment, and the fd
budget with its start gate."""
