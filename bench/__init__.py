"""The benchmarks: `python -m bench list`, `python -m bench NAME [options]` (see bench/suite.py)."""
