"""The `ubep` command line: one subcommand per area, each registered by its own module.

Each module listed in `_COMMAND_MODULES` defines `register(subparsers)`, which adds its
subcommand(s) with `set_defaults(func=handler)`; `handler(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = [
    "ubep.bench.cli",
    "ubep.moe.cli",
    "ubep.plan.cli",
    "ubep.sim.cli",
    "ubep.soak",
    "ubep.verify.cli",
    "ubep.warm",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ubep", description="Expert-parallel dispatch/combine for MoE (UBEP design).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


#: what the `cli` extra installs (`pip install 'ubep[cli]'`): tables, progress bars, plots,
#: the simulator's fit; `pip install ubep` alone leaves them out
CLI_EXTRA = ("rich", "matplotlib", "scipy", "yaml")


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The message for a command that needs the `cli` extra, or None if `error` is another
    missing module."""
    name = (error.name or "").split(".")[0]
    if name not in CLI_EXTRA:
        return None
    return (f"this command needs {name}, part of ubep's `cli` extra, which is not installed: "
            "pip install 'ubep[cli]'")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        why = missing_extra(e)
        if why is None:
            raise
        raise SystemExit(f"ubep {args.command}: {why}") from None


if __name__ == "__main__":
    sys.exit(main())
