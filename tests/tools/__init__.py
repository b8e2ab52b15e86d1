"""Tests of tools: the tree under tests/ mirrors the source tree."""
