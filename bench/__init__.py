"""Benchmarks and side-by-side peer comparisons (`make bench`); not part of tests or CI."""
