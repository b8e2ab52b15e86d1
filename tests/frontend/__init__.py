"""Tests of frontend: the tree under tests/ mirrors the source tree."""
