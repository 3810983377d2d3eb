"""The protocol check on the command line: `ubep verify` (or `python -m ubep.verify`).

    ubep verify                         # the matrix: variant x memory model
    ubep verify --trace tff_plain weak  # one counterexample, step by step
    ubep verify --sync-info             # the guarantee in force on this machine, checked
"""

from __future__ import annotations

import argparse
import sys

from ubep.verify import MODELS, check, check_all, variants


def add_args(ap: argparse.ArgumentParser) -> None:
    """The options of `ubep verify`."""
    ap.add_argument("--blocks", type=int, default=2, help="blocks per epoch (default 2)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    ap.add_argument("--repeat", action="store_true",
                    help="with --trace: the same data in every epoch")
    ap.add_argument("--trace", nargs=2, metavar=("VARIANT", "MODEL"),
                    help="print the counterexamples of one variant under one model")
    ap.add_argument("--sync-info", action="store_true",
                    help="print which guarantee each variant relies on here (ubep.sync_info)")


def register(subparsers) -> None:
    """Add `ubep verify` to the `ubep` command line."""
    ap = subparsers.add_parser("verify",
                               help="model-check the sync variants (sw/tff/dc/sp, direct)",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ubep.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Print the matrix, a trace or the sync info; 0 if every claim holds, 2 on bad input."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:      # piped: do not squeeze the table into 80 columns
        console = Console(width=120)
    if args.blocks < 1 or args.epochs < 1:
        console.print(f"[red]error:[/red] --blocks={args.blocks} and --epochs={args.epochs} "
                      f"must be >= 1")
        return 2
    if args.sync_info:
        from ubep.runtime.memory_model import sync_info

        info = sync_info(check=True)
        console.print(str(info), highlight=False)
        return 0 if info.verified else 1
    if args.trace:
        name, model = args.trace
        protos = {p.name: p for p in variants(args.blocks, args.epochs, args.repeat)}
        if name not in protos or model not in MODELS:
            console.print(f"[red]error:[/red] --trace {name} {model}: VARIANT must be one of "
                          f"{', '.join(protos)}; MODEL one of {', '.join(MODELS)}")
            return 2
        result = check(protos[name], model)
        console.print(str(result))
        for kind, steps in result.counterexamples.items():
            console.print(f"\n[bold]{kind}[/bold]:")
            for step in steps:
                console.print(f"  {step}")
        return 0

    table = Table(title=f"Data-as-Flag protocol check ({args.blocks} blocks, {args.epochs} "
                        f"epochs, every interleaving)")
    table.add_column("variant", no_wrap=True)
    for m in MODELS:
        table.add_column(m, no_wrap=True)
    table.add_column("claim holds", no_wrap=True)
    cells: dict[str, list[str]] = {}
    verdict: dict[str, bool] = {}
    protos = {}
    for proto, model, results in check_all(args.blocks, args.epochs):
        protos[proto.name] = proto
        bad = sorted({k for r in results for k in r.counterexamples})
        claimed = model in proto.claimed_models
        text = "ok" if not bad else "/".join(bad)
        style = "green" if not bad else "red"
        cells.setdefault(proto.name, []).append(
            f"[{style}]{text}[/{style}]" + (" *" if claimed else ""))
        verdict[proto.name] = verdict.get(proto.name, True) and (not bad) == claimed
    for name, row in cells.items():
        table.add_row(name, *row,
                      "yes" if verdict[name] else "[bold red]NO[/bold red]")
    console.print(table)
    for name, proto in protos.items():
        console.print(f"  {name}: {proto.description}")
    console.print("* = a model the variant claims; a claim holds when the variant is ok exactly "
                  "under the models it claims (data distinct per epoch and repeated).")
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
