"""Benchmarks of infosieve-fast against the published InfoSieve code (run from the repository root)."""
