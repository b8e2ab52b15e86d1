"""Ember's test suite; its folders mirror the source tree (tests/e2e: real processes end to end)."""
