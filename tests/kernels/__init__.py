"""Tests of kernels: the tree under tests/ mirrors the source tree."""
