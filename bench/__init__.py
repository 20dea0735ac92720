"""EdgeLoop benchmarks: `make bench` (python -m bench.run)."""
