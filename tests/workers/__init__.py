"""Tests of workers: the tree under tests/ mirrors the source tree."""
