"""`python -m ubep.gpu.bench`: BSP kernels vs the single UBEP kernel on one device.

For P emulated ranks x batch T x hidden H bf16 x top-k of E experts (default: P = 8, 16, 32;
T = 1, 16, 128; DeepSeek-V3's H = 7168, E = 256, top-8), times in one run, side by side:

* `bsp`: `EmulatedSuperpod(mode="bsp")`, one kernel per phase;
* `ubep`: `EmulatedSuperpod(mode="ubep")`, one kernel per call;
* `torch`: plain torch on the same device: dispatch `index_select` of every received row,
  combine `index_add_` of the weighted rows in fp32 (the indices made once, as the plans are);
* `copy`: `Tensor.copy_` of the same bytes (every received row read once and written once),
  the device-memory copy bound.

Every system's output is first checked against the others (bit-exact for dispatch), and
again after timing. Two times per call (see `Timer`): `graph_us`, device time of the call
replayed from a CUDA graph (the ratios use it), and `eager_us`, CUDA events around the
Python call (launches and host work included). Routing and planning are made before timing
for every system. Writes
`gpu_bench.csv` and `gpu_bench.png` into `--out`; needs only torch, triton, numba, numpy,
rich, matplotlib and this repository on PYTHONPATH.

`--smoke`: a tiny configuration on CPU under Triton's interpreter (the CI check that the
script runs; its times mean nothing).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SYSTEMS = ("bsp", "ubep", "torch", "copy")
OPS = ("dispatch", "combine")


def programs_for(num_ranks: int, resident: int | None) -> tuple[int, int, int]:
    """(count, send, receive) programs per rank: fill the device, half of them senders.

    4 per rank (1 + 2 + 1) when the device's size is unknown (the interpreter) or tight;
    at most 16 per rank.
    """
    per = 4 if resident is None else max(3, min(16, resident // num_ranks))
    send = per // 2
    return 1, send, per - 1 - send


class Timer:
    """Median µs per call, two ways.

    `eager`: CUDA events around each Python call (launches and host work included), or the
    host clock on CPU. `graph`: the call captured once in a CUDA graph, replayed `reps`
    times between two events, five times over: device time with no host in the way
    (None on CPU, or if capture fails, with the reason printed).
    """

    def __init__(self, device: torch.device, warmup: int, reps: int, log=print):
        self.device, self.warmup, self.reps, self.log = device, warmup, reps, log

    def eager(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize(self.device)
        pairs = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pairs.append((a, b))
        torch.cuda.synchronize(self.device)
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)

    def graph(self, fn: Callable[[], object], what: str) -> float | None:
        if self.device.type != "cuda":
            return None
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # report, keep measuring the rest
            self.log(f"    [yellow]{what}: no CUDA graph ({type(e).__name__}: {e})[/]")
            return None
        per_call = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(self.reps):
                g.replay()
            b.record()
            torch.cuda.synchronize(self.device)
            per_call.append(a.elapsed_time(b) * 1e3 / self.reps)
        return statistics.median(per_call)


def _routing(P: int, T: int, K: int, E: int, gen: torch.Generator):
    """Uniform top-k routing: for each token, K distinct experts; softmax-like weights."""
    scores = torch.rand(P, T, E, generator=gen)
    weights, idx = scores.topk(K, dim=-1)
    return idx.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).to(torch.float32)


def _torch_indices(routing, P: int, T: int, E: int, device: torch.device):
    """The oracle's order as flat indices: which source row each received row is, per rank."""
    idx = routing.topk_idx.to("cpu", torch.int64)
    src = []
    for r in range(P):
        for e in range(r * (E // P), (r + 1) * (E // P)):
            s, t, k = (idx == e).nonzero(as_tuple=True)   # (source, token) ascending
            src.append(torch.stack([s, t, k], dim=1))
    src = torch.cat(src)
    row = (src[:, 0] * T + src[:, 1]).to(device)
    slot = (row * idx.shape[2] + src[:, 2].to(device))
    return row, slot


def run_config(P: int, T: int, H: int, K: int, E: int, device: torch.device, dtype: torch.dtype,
               timer, resident: int | None, seed: int) -> list[dict]:
    """Time the four systems for one (P, T); check their outputs agree first."""
    from ubep.gpu import EmulatedSuperpod

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(P, T, H, generator=gen).to(dtype).to(device)
    idx, w = _routing(P, T, K, E, gen)
    C, S, R = programs_for(P, resident)
    pods = {m: EmulatedSuperpod(P, E, H, mode=m, device=device, count_programs=C,
                                send_programs=S, recv_programs=R) for m in ("bsp", "ubep")}
    routes = {m: pod.route(idx, w) for m, pod in pods.items()}
    rt = routes["ubep"]
    rows = sum(rt.num_recv)
    row, slot = _torch_indices(rt, P, T, E, device)
    x_flat = x.view(P * T, H)
    w_flat = rt.topk_weights.view(-1)
    recv = torch.empty(rows, H, dtype=dtype, device=device)
    copy_src = torch.empty(rows, H, dtype=dtype, device=device)   # contents do not matter
    copy_dst = torch.empty_like(copy_src)

    def torch_dispatch():
        return torch.index_select(x_flat, 0, row, out=recv)

    def torch_combine(out):
        y = torch.zeros(P * T, H, dtype=torch.float32, device=device)
        y.index_add_(0, row, out.float() * w_flat[slot, None])
        return y.to(dtype)

    def same_as_torch(m: str, got, when: str) -> None:
        rows_of = torch.cat([got.recv_x[r, :got.num_recv[r]] for r in range(P)])
        if not torch.equal(rows_of.view(torch.int16), want.view(torch.int16)):
            raise RuntimeError(f"P={P} T={T}: mode {m!r} dispatch differs from torch's {when}")

    # agreement: both executors' rows equal torch's, bit for bit; combines within fp32 tolerance
    want = torch_dispatch()
    y_want = torch_combine(want)
    views = {}   # the superpods' receive buffers, as views
    for m, pod in pods.items():
        got = views[m] = pod.dispatch(x, routes[m])
        same_as_torch(m, got, "before timing")
        torch.testing.assert_close(pod.combine(got.recv_x, got).view(P * T, H), y_want,
                                   msg=lambda s, m=m: f"{m} combine: {s}")

    times = {
        ("dispatch", "torch"): (timer.eager(torch_dispatch), timer.graph(torch_dispatch,
                                                                         "torch dispatch")),
        ("combine", "torch"): (timer.eager(lambda: torch_combine(want)),
                               timer.graph(lambda: torch_combine(want), "torch combine")),
        ("dispatch", "copy"): (timer.eager(lambda: copy_dst.copy_(copy_src)),
                               timer.graph(lambda: copy_dst.copy_(copy_src), "copy")),
    }
    times[("combine", "copy")] = times[("dispatch", "copy")]
    for m, pod in pods.items():
        fn = lambda pod=pod, m=m: pod.dispatch(x, routes[m], check=False)  # noqa: E731
        times[("dispatch", m)] = (timer.eager(fn), timer.graph(fn, f"{m} dispatch"))
        # the receive buffers hold the last timed call's rows (a graph replay where there is
        # one): after hundreds of back-to-back calls they are still torch's rows
        pod.check()
        same_as_torch(m, views[m], "after timing")
        got = pod.dispatch(x, routes[m])
        fn = lambda pod=pod, got=got: pod.combine(got.recv_x, got, check=False)  # noqa: E731
        times[("combine", m)] = (timer.eager(fn), timer.graph(fn, f"{m} combine"))
        pod.check()
    nbytes = rows * H * x.element_size()
    out = []
    for op in OPS:
        for system in SYSTEMS:
            eager, graph = times[(op, system)]
            us = graph if graph is not None else eager
            out.append(dict(ranks=P, batch=T, hidden=H, top_k=K, experts=E, op=op,
                            system=system, programs_per_rank=f"{C}+{S}+{R}", rows=rows,
                            bytes=nbytes, eager_us=round(eager, 2),
                            graph_us=None if graph is None else round(graph, 2),
                            us=round(us, 2), GBps=round(2 * nbytes / us / 1e3, 1)))
    return out


def _ratios(rows: list[dict]) -> list[dict]:
    """bsp/ubep, ubep/copy, torch/ubep per (P, T, op), on `us` (graph time where measured)."""
    t = {(r["ranks"], r["batch"], r["op"], r["system"]): r["us"] for r in rows}
    keys = sorted({(r["ranks"], r["batch"], r["op"]) for r in rows},
                  key=lambda k: (k[0], k[1], OPS.index(k[2])))
    return [dict(ranks=P, batch=T, op=op,
                 bsp_over_ubep=t[(P, T, op, "bsp")] / t[(P, T, op, "ubep")],
                 ubep_over_copy=t[(P, T, op, "ubep")] / t[(P, T, op, "copy")],
                 torch_over_ubep=t[(P, T, op, "torch")] / t[(P, T, op, "ubep")])
            for P, T, op in keys]


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(len(OPS), len(ranks), figsize=(max(4 * len(ranks), 7), 6.5),
                             squeeze=False, sharex=True)
    for i, op in enumerate(OPS):
        for j, P in enumerate(ranks):
            ax = axes[i][j]
            for system in SYSTEMS:
                pts = sorted((r["batch"], r["us"]) for r in rows
                             if r["op"] == op and r["ranks"] == P and r["system"] == system)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {P} emulated ranks")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("µs per call (CUDA graph; eager on CPU)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("ubep.gpu: BSP kernels, one UBEP kernel, torch, copy bound (one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ubep.gpu.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("gpu_bench"))
    p.add_argument("--smoke", action="store_true",
                   help="tiny run on CPU under Triton's interpreter (checks the script)")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.ranks, a.batch, a.hidden, a.top_k, a.experts = [2], [1, 4], 64, 2, 8
        a.reps, a.warmup = 1, 0
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        p.error("no CUDA device: this script measures a GPU (--smoke checks it on CPU)")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    from rich.console import Console
    from rich.table import Table

    from ubep.gpu import kernels

    if device.type == "cpu" and not kernels.INTERPRETED:
        p.error("--smoke needs TRITON_INTERPRET=1 before Triton is imported")
    resident = None if device.type == "cpu" else \
        torch.cuda.get_device_properties(device).multi_processor_count
    for P in a.ranks:
        if a.experts % P:
            p.error(f"--experts={a.experts} must be divisible by every --ranks value ({P})")
    console = Console(width=150)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    console.print(f"[bold]ubep.gpu bench[/] on {name}: hidden {a.hidden} bf16, top-{a.top_k} "
                  f"of {a.experts} experts, median of {a.reps} calls")
    start = time.perf_counter()
    rows: list[dict] = []
    failed: list[str] = []
    for P in a.ranks:
        for T in a.batch:
            try:
                rows += run_config(P, T, a.hidden, a.top_k, a.experts, device, torch.bfloat16,
                                   Timer(device, a.warmup, a.reps, console.print), resident,
                                   a.seed)
            except Exception as e:   # one failed point must not cost the rest of the run
                failed.append(f"P={P} T={T}: {type(e).__name__}: {e}")
                console.print(f"  [red]P={P:3d} T={T:4d} failed[/]: {failed[-1]}")
                continue
            console.print(f"  P={P:3d} T={T:4d} done ({time.perf_counter() - start:.0f} s)")
    if not rows:
        console.print("[red]no configuration ran[/]")
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "gpu_bench.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    _plot(rows, a.out / "gpu_bench.png")
    t = {(r["ranks"], r["batch"], r["op"], r["system"]): r for r in rows}
    mode = "CUDA graph" if any(r["graph_us"] is not None for r in rows) else "eager"
    table = Table(title=f"µs per call ({mode}); ratios from this one run")
    for col in ("P", "T", "op", *SYSTEMS, "ubep eager", "bsp/ubep", "ubep/copy", "torch/ubep"):
        table.add_column(col, justify="right")
    for q in _ratios(rows):
        key = (q["ranks"], q["batch"], q["op"])
        table.add_row(str(q["ranks"]), str(q["batch"]), q["op"],
                      *(f"{t[key + (s,)]['us']:.1f}" for s in SYSTEMS),
                      f"{t[key + ('ubep',)]['eager_us']:.1f}",
                      f"{q['bsp_over_ubep']:.2f}", f"{q['ubep_over_copy']:.2f}",
                      f"{q['torch_over_ubep']:.2f}")
    console.print(table)
    console.print(f"wrote {a.out / 'gpu_bench.csv'} and {a.out / 'gpu_bench.png'} "
                  f"in {time.perf_counter() - start:.0f} s")
    for f in failed:
        console.print(f"[red]failed[/] {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
