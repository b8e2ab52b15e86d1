"""Tests of coreproc/text: the tree under tests/ mirrors the source tree."""
