"""`python -m coreproc batch -i in.jsonl -o out.jsonl [engine flags]`: batch mode without the `ember` CLI.

The same as `ember batch` (coreproc.client.batch), parsed here so the scheduler layer needs nothing of the
frontend: errors a user can fix exit 2 with one line, anything else with its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from coreproc.base.config import ENGINE_SECTIONS, add_engine_arguments
from coreproc.base.errors import run_command
from coreproc.base.options import flags
from coreproc.client import batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coreproc", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    bt = sub.add_parser("batch", help="run an OpenAI batch file (JSONL in, JSONL out) through the engine")
    batch.add_arguments(bt)
    add_engine_arguments(bt)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    debug = args.log_level.upper() == "DEBUG"
    return run_command("python -m coreproc batch", lambda: batch.run(args), debug, flags(ENGINE_SECTIONS))


if __name__ == "__main__":
    sys.exit(main())
