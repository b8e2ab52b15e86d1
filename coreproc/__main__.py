"""`python -m coreproc ...`: the same commands as `ember` (e.g. `python -m coreproc batch -i in.jsonl`)."""

from __future__ import annotations

import sys

from frontend.cli import main

sys.exit(main())
