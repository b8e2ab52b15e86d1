"""Tests of coreproc/base: the tree under tests/ mirrors the source tree."""
