"""bench: benchmarks; each prints one JSON object and compares against a baseline in the same run."""
