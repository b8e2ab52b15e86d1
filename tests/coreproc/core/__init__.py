"""Tests of coreproc/core: the tree under tests/ mirrors the source tree."""
