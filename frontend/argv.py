"""What an `ember` command line asks for, read without argparse (which would import every subcommand).

Runs in the user's shell process: the `ember` command's launcher and its CLI use it before they know
which modules to import.
"""

from __future__ import annotations


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (None for none or --help): only its module needs importing."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to `flag` (`--flag V` or `--flag=V`), None if absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
