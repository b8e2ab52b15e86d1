"""Helpers of `tools/compare_peers.py`: install steps and one runner script per peer engine.

The runner scripts (`run_*.py`) are self-contained: each is started in its own process, with the
Python of the peer's own environment, reads a JSON job file and prints one JSON result line. None of
the peers is a dependency of Ember; they live in throwaway venvs and build folders under --work-dir.
"""
