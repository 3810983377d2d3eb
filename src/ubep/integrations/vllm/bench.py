"""`ubep e2e --engine vllm`: TPOT of vLLM with DP 2 + EP through ubep vs one engine, no EP.

`--batch b` is the number of sequences each engine decodes at once: one engine runs b, each
of the two DP ranks runs b (2b in all). Every DP rank must have requests: vLLM 0.32.0's
offline data-parallel engines run no dummy forward for an idle rank, so a rank without
requests leaves its peer waiting in the MoE exchange until the executor's RPC timeout.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from typing import Any

import numpy as np

from ubep.integrations.vllm.engine import EngineRun, make_tiny_checkpoint, run_engines

#: (label, data-parallel ranks, expert parallel)
SETUPS = (("1 engine, no EP", 1, False), ("DP 2 + EP (ubep)", 2, True))


def _prompts(batch: int, prompt_len: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)          # a prefix of a longer list: the same first prompts
    return tuple(tuple(rng.randrange(512) for _ in range(prompt_len)) for _ in range(batch))


def summarize(tpot_ms: dict[int, list[float]]) -> dict[str, Any]:
    """TPOT P50/P99 over the requests of every rank."""
    samples = [t for per_rank in tpot_ms.values() for t in per_rank]
    if not samples:
        return {"samples": 0, "p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"samples": len(samples), "p50_ms": float(np.percentile(samples, 50)),
            "p99_ms": float(np.percentile(samples, 99))}


def run_vllm(args: argparse.Namespace) -> None:
    """Both setups on the tiny Qwen3-MoE, each batch size in turn on the same engines."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(make_tiny_checkpoint(args.out / "tiny-qwen3-moe", seed=args.seed))
    runs: dict[str, dict[str, Any]] = {}
    for label, dp, ep in SETUPS:
        warm = _prompts(2 * dp, args.prompt_len, args.seed + 99)
        workloads = (warm,) + tuple(_prompts(b * dp, args.prompt_len, args.seed)
                                    for b in args.batch)
        # at least 32 requests per engine and batch size, so that P99 means something
        repeats = (1,) + tuple(max(2, 32 // b) for b in args.batch)
        with console.status(f"vLLM {label}: {len(args.batch)} batch sizes, "
                            f"{args.steps} tokens each ..."):
            runs[label] = run_engines(EngineRun(
                model=model, dp=dp, expert_parallel=ep, workloads=workloads,
                repeats=repeats, max_tokens=args.steps, timeout_s=args.timeout))
    table = Table(title="vLLM (CPU, fp32, tiny Qwen3-MoE): time per output token, ms")
    for col in ("setup", "batch / engine", "P50", "P99", "samples", "tokens = 1 engine",
                "ubep dispatch+combine / forward"):
        table.add_column(col, justify="right")
    rows = []
    base = runs[SETUPS[0][0]]["workloads"]
    for label, dp, _ in SETUPS:
        res = runs[label]
        comm = _comm_per_step(res, dp)
        for i, batch in enumerate(args.batch):
            w = res["workloads"][i + 1]
            s = summarize(w["tpot_ms"])
            # the first b prompts are the same in both setups: compare those
            match = all(w["tokens"][k] == t for k, t in base[i + 1]["tokens"].items())
            rows.append({"setup": label, "batch": batch, **s, "tokens_match": match,
                         "ubep_ms_per_step": comm})
            table.add_row(label, str(batch), f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}",
                          str(s["samples"]), "yes" if match else "NO",
                          "-" if comm is None else f"{comm:.3f} ms")
    console.print(table)
    with open(args.out / "vllm_tpot.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["setup", "batch", "rank", "request", "tpot_ms"])
        for label, _, _ in SETUPS:
            for i, batch in enumerate(args.batch):
                for rank, values in runs[label]["workloads"][i + 1]["tpot_ms"].items():
                    for k, ms in enumerate(values):
                        out.writerow([label, batch, rank, k, f"{ms:.4f}"])
    (args.out / "vllm_summary.json").write_text(json.dumps(
        {"rows": rows, "moe_layers": {k: v["moe_layers"] for k, v in runs.items()},
         "tokens_per_request": args.steps, "prompt_len": args.prompt_len},
        indent=2, default=str))
    console.print(f"wrote {args.out}/vllm_tpot.csv, vllm_summary.json")


def _comm_per_step(res: dict[str, Any], dp: int) -> float | None:
    """Mean ms per forward that one rank spent in ubep's dispatch+combine (all layers)."""
    if dp == 1:
        return None
    per_rank = []
    for layers in res["moe_layers"].values():
        calls = max((lay["dispatches"] or 0) for lay in layers) if layers else 0
        total = sum((lay["dispatch_s"] or 0) + (lay["combine_s"] or 0) for lay in layers)
        if calls:
            per_rank.append(total / calls * 1e3)
    return float(np.mean(per_rank)) if per_rank else None
