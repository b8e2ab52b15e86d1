"""Where things are in the repository, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "coreproc" / "assets"  # the bundled model and draft
PLUGINS = REPO / "tests" / "plugins"  # an installed-looking logits-processor plugin
