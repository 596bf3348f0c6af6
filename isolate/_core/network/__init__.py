"""``Sandbox(network=...)``: the plan, the allow-list, the listeners taken from the worker, and
the egress proxy with its bytes (requests parsed, answers, copying)."""
