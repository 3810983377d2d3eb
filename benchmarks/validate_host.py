"""`python -m benchmarks validate-host`: the host model's predictions beside `ubep bench`'s
medians on this machine (`benchmarks.host`, timed in interleaved chunks by
`benchmarks.hostchunks`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from benchmarks import host, hostchunks


def register(subparsers) -> None:
    """Add `validate-host` to the `python -m benchmarks` command line."""
    s = subparsers.add_parser(
        "validate-host", help="the host model vs `ubep bench` on this machine",
        description="count the pages each call faults, then time this host's passes over rows "
        "(benchmarks.hostbench) and `ubep bench`'s calls (shm-bsp/ubep/direct, P=2, 7168 bf16, "
        "top-8, batch 1/8/16/128) in alternating sub-second chunks, all under the bench lock, "
        "and print the host model's prediction next to the measured medians")
    s.add_argument("--bench-out", type=Path, default=Path("results/validate_host"),
                   help="the bench's output folder (reused if it holds a finished run and "
                   "--reuse is given)")
    s.add_argument("--bench-repeats", type=int, default=None, metavar="N",
                   help="rounds (default 3); each round takes every batch for a few bench "
                   "chunks, each between two tables of the model's passes "
                   "(benchmarks.hostchunks)")
    s.add_argument("--reuse", action="store_true",
                   help="read --bench-out (chunks.json, fault counts) instead of measuring "
                   "again")
    s.set_defaults(func=validate_host_main)


def validate_host_main(args: argparse.Namespace) -> int:
    """Predicted vs measured `ubep bench` medians on this host (`benchmarks.host`), the table
    and the bench interleaved in short chunks (`benchmarks.hostchunks`)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    out = args.bench_out
    faults_file, chunks_file = out / "host_faults.json", out / "chunks.json"
    reuse = args.reuse and chunks_file.exists() and faults_file.exists()
    rounds = hostchunks.ROUNDS if args.bench_repeats is None else args.bench_repeats
    if rounds < 1:
        console.print(f"--bench-repeats={rounds}: must be >= 1")
        return 2
    if reuse:
        faults = {tuple(k.split(":")[:2]) + (int(k.split(":")[2]),): v
                  for k, v in json.loads(faults_file.read_text()).items()}
        rec = json.loads(chunks_file.read_text())
    else:
        out.mkdir(parents=True, exist_ok=True)
        console.print(f"waiting for {host.BENCH_LOCK} ...")
        with host.bench_lock():
            console.print(f"load {os.getloadavg()[0]:.2f}: counting the pages each call "
                          "faults (the runtime, bench pattern)")
            faults = host.count_faults()
            faults_file.write_text(json.dumps({f"{s}:{o}:{b}": v
                                               for (s, o, b), v in faults.items()}, indent=1))
            spec = hostchunks.ChunkSpec(rounds=rounds)
            console.print(f"{rounds} rounds x {len(spec.batches)} batches x {spec.chunks} "
                          f"bench chunks ({spec.iters} calls per system and hidden), a "
                          f"table of the model's passes before and after each chunk, into "
                          f"{out} ...")
            rec = hostchunks.run_chunks(out, spec)
    if any(v > 0 for v in faults.values()):
        console.print("[yellow]calls fault pages: the interleaved tables do not time "
                      "first_touch; faults are priced at 0[/yellow]")
    rows = hostchunks.validate_chunks(rec, faults)
    tab = Table(title="host model vs ubep bench's timing (P=2, hidden 7168 bf16, top-8), "
                f"load {rec['load']:.2f} at the start; each bench chunk predicted from the "
                "tables timed right before and after it; medians over the kept chunks, "
                "error: the median of their own errors")
    for col in ("system", "batch", "op", "footprint MB", "per-call us", "predicted us",
                "range", "measured us", "range ", "error", "chunks kept"):
        tab.add_column(col, justify="left" if col in ("system", "op") else "right")
    for r in rows:
        tab.add_row(r["system"], str(r["batch"]), r["op"], f"{r['footprint_MB']:.1f}",
                    f"{r['call_us']:.1f}", f"{r['predicted_us']:.1f}",
                    f"{r['predicted_lo_us']:.0f}-{r['predicted_hi_us']:.0f}",
                    f"{r['measured_us']:.1f}",
                    f"{r['measured_lo_us']:.0f}-{r['measured_hi_us']:.0f}",
                    f"{r['error']:+.2f}",
                    f"{r['kept']}/{r['chunks']}" + (" (none settled: all)"
                                                    if r["unsettled"] else ""))
    if console.width < 132:              # a pipe or a narrow terminal: do not truncate
        console.width = 132
    console.print(tab)
    ok = sum(abs(r["error"]) <= 0.25 for r in rows)
    kept, chunks = sum(r["kept"] for r in rows), sum(r["chunks"] for r in rows)
    console.print(f"within +-25%: {ok} of {len(rows)}; chunks kept {kept} of {chunks} "
                  f"(dropped: the tables around them disagreed by more than "
                  f"{hostchunks.TOLERANCE:.0%}); {rec['wall_s']:.0f} s of chunks")
    alt = hostchunks.validate_chunks(rec, faults, stat="median")
    console.print(f"with each table point the median of the two processes instead of the "
                  f"slower: {sum(abs(r['error']) <= 0.25 for r in alt)} of {len(alt)}")
    warm = hostchunks.validate_chunks(rec, faults, overhead="warm")
    misses = ", ".join(f"{r['system']} b{r['batch']} {r['op']} {100 * r['error']:+.0f}%"
                       for r in warm if abs(r["error"]) > 0.25)
    console.print(f"with the per-call overhead of back-to-back hidden-64 calls (warm caches) "
                  f"instead of those right after a hidden-7168 call: "
                  f"{sum(abs(r['error']) <= 0.25 for r in warm)} of {len(warm)}"
                  + (f" (misses: {misses})" if misses else ""))
    for b, per in hostchunks.states(rec).items():
        parts = []
        for name, v in per.items():
            a = np.array(v)                              # [tables, processes]
            ranks = ", ".join(f"process {i} {a[:, i].min():.2f}-{a[:, i].max():.2f}"
                              for i in range(a.shape[1]))
            hi = a.max(axis=1)
            parts.append(f"{name} {ranks}; slower/faster median "
                         f"{np.median(hi / a.min(axis=1)):.2f}; "
                         f"{int((hi > 2 * hi.min()).sum())} over twice the lowest")
        console.print(f"b{b}, us per 14 KB row over {len(v)} tables: " + " | ".join(parts))
    if rec["others"].get("cores", 0) > 0.05:
        console.print(escape(f"during the chunks: {rec['others_text']}"))
    else:
        console.print("no other process used more than 0.05 cores during the chunks")
    (out / "validate_host.json").write_text(json.dumps(
        {"rows": rows, "states": hostchunks.states(rec), "load": rec["load"],
         "wall_s": rec["wall_s"], "others": rec["others"]}, indent=1))
    (out / "validate_host.md").write_text(host.markdown_table(rows))
    console.print(f"tables: {out / 'validate_host.json'}, {out / 'validate_host.md'}")
    return 0
