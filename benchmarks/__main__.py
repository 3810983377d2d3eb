"""`python -m benchmarks <command>`: the lab's entry point (run from a checkout's root).

Commands: `results` (regenerate docs/results.md), `validate-host` (the host model vs
`ubep bench`), and every script of `benchmarks/scripts` by its name, e.g.
`python -m benchmarks bench_host_gaps 3 8` (the arguments after the name are the script's).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def scripts() -> list[str]:
    """The names of the measurement scripts (`benchmarks/scripts/bench_*.py`)."""
    return sorted(p.stem for p in SCRIPTS.glob("bench_*.py"))


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import results, validate_host

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
        epilog="scripts (python -m benchmarks NAME [ARGS ...]): " + ", ".join(scripts()))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    results.register(sub)
    validate_host.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in scripts():
        sys.argv = [str(SCRIPTS / f"{argv[0]}.py"), *argv[1:]]
        runpy.run_module(f"benchmarks.scripts.{argv[0]}", run_name="__main__", alter_sys=True)
        return 0
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
