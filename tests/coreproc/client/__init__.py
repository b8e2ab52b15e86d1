"""Tests of coreproc/client: the tree under tests/ mirrors the source tree."""
