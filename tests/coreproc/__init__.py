"""Tests of coreproc: the tree under tests/ mirrors the source tree."""
