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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
