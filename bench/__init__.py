"""Side-by-side benchmarks of isolate against the other ways to run an episode."""
