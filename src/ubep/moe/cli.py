"""`ubep e2e`: greedy MoE decoding with EP on P processes, TPOT per communication backend."""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict
from pathlib import Path

from ubep.moe.e2e import (
    BACKEND_SPECS,
    UNSPLIT,
    E2EConfig,
    RankReport,
    TPOTSummary,
    available_backends,
    e2e_rank,
    plot_tpot,
    summarize,
)
from ubep.moe.models import ARCHS, SIZES
from ubep.options import SCHEDULES, SYNCS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "e2e", help="end-to-end MoE decoding with EP: TPOT per backend",
        description="Greedy decoding of a small Qwen3-MoE / DeepSeek-V3 model (seeded random "
                    "weights) on P processes, MoE blocks through ubep.Buffer; prints TPOT "
                    "P50/P99 per backend and the dispatch+combine share of a step, writes a "
                    "CSV of step latencies, a JSON summary and a violin plot normalised to "
                    "gloo.")
    p.add_argument("--engine", choices=("ubep", "vllm"), default="ubep",
                   help="ubep: ubep's own MoE decoder; vllm: vLLM with DP 2 + EP through ubep "
                        "vs one engine without EP (needs vLLM: make vllm-venv)")
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--size", choices=SIZES, default="small",
                   help="model preset (small: the issue's sizes; tiny: the tests')")
    p.add_argument("--ranks", type=int, default=2, help="processes P (default 2)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16],
                   help="sequences per rank (default 1 16)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per run (default 32)")
    p.add_argument("--warmup", type=int, default=4,
                   help="first steps left out of the statistics (default 4)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--backends", nargs="+", choices=list(BACKEND_SPECS), default=None,
                   help="default: every backend built here")
    p.add_argument("--sync", choices=SYNCS, default=None,
                   help="Data-as-Flag variant of the shm runtime (default: the Buffer's)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="token-to-worker schedule of the shm runtime (default: the Buffer's)")
    p.add_argument("--workers", type=int, default=None,
                   help="shm worker threads per rank (default: cores / ranks)")
    p.add_argument("--no-unsplit", action="store_true",
                   help="skip the unsplit (single-process-per-rank) reference run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds before a run's ranks are killed")
    p.add_argument("--out", type=Path, default=Path("results/e2e"), help="output folder")
    p.set_defaults(func=run)


def _tokens_match(reports: list[RankReport], backend: str, batch: int) -> bool | None:
    """Whether `backend` produced the unsplit model's tokens on every rank (None: no ref)."""
    match = True
    for rep in reports:
        runs = {r.backend: r.result for r in rep.runs if r.batch == batch}
        if UNSPLIT not in runs:
            return None
        match &= bool((runs[UNSPLIT].tokens == runs[backend].tokens).all())
    return match


def _command_line(args: argparse.Namespace) -> str:
    """The `ubep e2e` command line that reproduces `args` (defaults spelled out)."""
    parts = ["ubep", "e2e"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        parts.append("--" + key.replace("_", "-"))
        if value is not True:
            parts += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from ubep.integrations.vllm.bench import run_vllm

        run_vllm(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    from ubep.testing import run_ranks

    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table to 80 columns
        console = Console(width=140)
    built = available_backends()
    backends = args.backends or built
    missing = [b for b in backends if b not in built]
    if missing:
        raise ValueError(f"--backends {' '.join(missing)}: not built here (built: "
                         f"{', '.join(built)})")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup={args.warmup} must be < --steps={args.steps}")
    buffer_options = tuple((k, getattr(args, k)) for k in ("sync", "schedule", "workers")
                           if getattr(args, k) is not None)
    args.out.mkdir(parents=True, exist_ok=True)
    summaries: list[TPOTSummary] = []
    matches: dict[tuple[str, int, str], bool | None] = {}
    params: dict[str, dict] = {}
    for arch in args.arch:
        cfg = E2EConfig(arch=arch, size=args.size, batches=tuple(args.batch), steps=args.steps,
                        prompt_len=args.prompt_len, backends=tuple(backends), seed=args.seed,
                        dtype=args.dtype, reference=not args.no_unsplit, threads=args.threads,
                        buffer_options=buffer_options)
        t0 = time.monotonic()
        with console.status(f"{arch}: decoding on {args.ranks} ranks through "
                            f"{', '.join(backends)} ..."):
            reports = run_ranks(e2e_rank, args.ranks, cfg, timeout_s=args.timeout)
        console.print(f"{arch}: done in {time.monotonic() - t0:.1f}s")
        rows = summarize(arch, reports, warmup=args.warmup)
        summaries += rows
        for s in rows:
            if s.backend != UNSPLIT:
                matches[(arch, s.batch, s.backend)] = _tokens_match(reports, s.backend, s.batch)
        params[arch] = {"params_full": reports[0].params_full,
                        "params_ep_per_rank": [r.params_ep for r in reports]}

    shm_options = "".join(f", {k}={v}" for k, v in buffer_options)
    table = Table(title=f"TPOT, P={args.ranks}, size={args.size}, {args.dtype}, "
                        f"{args.steps - args.warmup} measured steps{shm_options}")
    for col in ("arch", "batch", "backend", "P50 ms", "P99 ms", "mean ms", "comm ms",
                "experts ms", "comm share",
                "P50 vs gloo", "tokens = unsplit"):
        table.add_column(col, justify="left" if col in ("arch", "backend") else "right",
                         no_wrap=True)
    for s in summaries:
        m = matches.get((s.arch, s.batch, s.backend))
        table.add_row(s.arch, str(s.batch), s.backend, f"{s.p50_ms:.2f}", f"{s.p99_ms:.2f}",
                      f"{s.mean_ms:.2f}",
                      f"{s.comm_p50_ms:.2f}" if s.backend != UNSPLIT else "-",
                      f"{s.experts_p50_ms:.2f}" if s.backend != UNSPLIT else "-",
                      f"{s.comm_share:.0%}" if s.backend != UNSPLIT else "-",
                      f"{s.norm_p50:.2f}x" if s.norm_p50 else "-",
                      "-" if m is None else ("yes" if m else "NO"))
    console.print(table)

    with open(args.out / "e2e_steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arch", "batch", "backend", "step", "latency_ms"])
        for s in summaries:
            for i, v in enumerate(s.latencies_ms):
                w.writerow([s.arch, s.batch, s.backend, i + args.warmup, f"{v:.4f}"])
    summary = {
        "command": _command_line(args),
        "ranks": args.ranks, "size": args.size, "dtype": args.dtype, "steps": args.steps,
        "warmup": args.warmup, "params": params,
        "rows": [{**{k: v for k, v in asdict(s).items() if k != "latencies_ms"},
                  "tokens_match_unsplit": matches.get((s.arch, s.batch, s.backend))}
                 for s in summaries],
    }
    (args.out / "e2e_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_tpot(summaries, args.out / "e2e_tpot.png")
    console.print(f"wrote {args.out}/e2e_steps.csv, e2e_summary.json, e2e_tpot.png")
    return 0 if all(m is not False for m in matches.values()) else 1
