"""Tests of e2e: the tree under tests/ mirrors the source tree."""
