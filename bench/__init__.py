"""Benchmarks of the lease store against its baselines, and of catch-up and task overhead.

Not part of the test suite. Run ``python -m bench`` (see docs/benchmarks.md).
"""
