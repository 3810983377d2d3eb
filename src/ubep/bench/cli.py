"""`ubep bench` and `ubep demo`: measure dispatch+combine for real, side by side.

`ubep bench` times the systems a user could pick on this host (shm-owned, what
`backend="auto"` gives, shm-ubep, shm-direct, shm-bsp, torch/gloo, and with `--peers` the MPI
peer and the AgRs peer, vLLM's all-gather + reduce-scatter) against the copy bound and the
torch backend's raw collectives, on the same routing, and prints median/p99 with ratios; CSV,
JSON and a PNG go to `--out`.
`ubep demo` (what `make demo` runs) is a short DeepSeek-like bench.

Hook for the sync-variant sweep (`ubep bench --sync-sweep`, module
`ubep.bench.sync_sweep`): its `add_sync_sweep_args(parser)` adds `--sync-sweep` and its
`--sweep-*` options to `bench`; with `--sync-sweep`, its `run_sync_sweep_command(args)`
runs instead of the side-by-side bench.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from ubep.bench.config import DEFAULT_SYSTEMS, EXPERT_STEPS, PRESETS, SYSTEMS, BenchConfig

PEERS_HIDDENS = (2048, 7168)
PEERS_BATCHES = (1, 8, 16, 64, 128)
DEMO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def _sync_sweep_module():
    try:
        return importlib.import_module("ubep.bench.sync_sweep")
    except ImportError:
        return None


def register(subparsers) -> None:
    """Add `bench` and `demo` to the `ubep` command line."""
    p = subparsers.add_parser(
        "bench", help="time dispatch+combine: shm-ubep, shm-bsp, torch (gloo), MPI, bound",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="process counts P (default 2; with --peers also 4 if the host has "
                        ">= 4 cores)")
    p.add_argument("--hidden", type=int, nargs="+", default=None,
                   help="row widths (default 7168; with --peers 2048 7168)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="batch sizes, tokens per rank (default 1 8 16 64 128)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=None,
                   help="global expert count (default 16)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="row dtype (default bfloat16; with --fp8 combine's)")
    p.add_argument("--fp8", action="store_true", default=None,
                   help=BenchConfig.__dataclass_fields__["fp8"].metadata["help"])
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="a named shape; deepep-ll: DeepEP's low-latency tables (128 tokens a "
                        "rank, hidden 7168, top-8 of 256 experts, fp8 dispatch with scales, "
                        "bf16 combine); flags given beside it override its values")
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS, metavar="SYSTEM",
                   help=f"systems to compare, of {', '.join(SYSTEMS)} "
                        f"(default {' '.join(DEFAULT_SYSTEMS)}; the copy bound always runs)")
    p.add_argument("--backend", choices=("shm", "torch"), default=None,
                   help="time one Buffer backend only (with --mode for shm)")
    p.add_argument("--mode", choices=("ubep", "bsp"), default=None,
                   help="with --backend shm: the execution mode")
    p.add_argument("--peers", action="store_true",
                   help="add the peers (MPI under mpiexec; AgRs, vLLM's all-gather + "
                        "reduce-scatter) and use the peer sweep defaults")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per point (default 100; with --hosts, timed calls "
                        "per line and batch, in turns of 3: default 12)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations per point")
    p.add_argument("--block", type=int, default=20,
                   help="timed iterations each system runs back to back per round, after "
                        "one untimed call that follows the previous system (1: interleave "
                        "every iteration, each call then starts on caches another system "
                        "evicted)")
    p.add_argument("--routing", default="uniform", help="routing kind (ubep.testing)")
    p.add_argument("--expert", default=BenchConfig.expert, choices=EXPERT_STEPS,
                   help=BenchConfig.__dataclass_fields__["expert"].metadata["help"])
    p.add_argument("--workers", type=int, default=None, help="shm worker threads per rank")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave ranks unbound (default: rank r runs on the r-th usable core "
                        "when there are at least as many cores as ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="whole-run limit, seconds")
    p.add_argument("--out", default=None,
                   help="output folder for bench.csv, samples.csv, run.json, bench.png "
                        "(default results/bench/<time>)")
    p.add_argument("--hosts", type=int, default=None, metavar="H",
                   help="across hosts: H emulated hosts (network namespaces, a private "
                        "/dev/shm each; needs root), the default Buffer (hybrid there) vs "
                        "backend='torch' vs their bare network messages (ubep.bench.multihost)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="with --hosts: ranks on each")
    p.add_argument("--link-rate", default=None,
                   help="with --hosts: each host's link per direction, e.g. 1gbit (tc tbf)")
    mod = _sync_sweep_module()
    if mod is not None:
        mod.add_sync_sweep_args(p)       # --sync-sweep and its --sweep-* options
    else:
        p.add_argument("--sync-sweep", action="store_true", help="(not built yet)")
    p.set_defaults(func=_bench_main)

    d = subparsers.add_parser("demo", help="a short DeepSeek-like bench (what `make demo` runs)")
    d.add_argument("--iters", type=int, default=40, help="timed iterations per point")
    d.add_argument("--out", default="results/demo", help="output folder")
    d.set_defaults(func=_demo_main)


def _config_from_args(args) -> BenchConfig:
    systems = args.systems
    if args.backend is not None:
        if systems is not None:
            raise ValueError("give --systems or --backend/--mode, not both")
        if args.backend == "torch":
            if args.mode is not None:
                raise ValueError("--mode applies to --backend shm only")
            systems = ["torch"]
        else:
            systems = [f"shm-{args.mode}"] if args.mode else ["shm-owned", "shm-ubep",
                                                               "shm-direct", "shm-bsp"]
    elif args.mode is not None:
        raise ValueError("--mode needs --backend shm")
    if systems is None:
        systems = list(DEFAULT_SYSTEMS)
    if args.peers:
        systems = [*systems, *(p for p in ("mpi", "agrs") if p not in systems)]
    ranks = args.ranks
    if ranks is None:
        ranks = [2, 4] if args.peers and (os.cpu_count() or 1) >= 4 else [2]
    preset = PRESETS.get(args.preset, {})

    def given(value, key, default):
        """The flag's value if given, else the preset's, else the default."""
        return value if value is not None else preset.get(key, default)

    hiddens = given(args.hidden, "hiddens", PEERS_HIDDENS if args.peers else (7168,))
    return BenchConfig(ranks=tuple(ranks), hiddens=tuple(hiddens),
                       batches=tuple(given(args.tokens, "batches", PEERS_BATCHES)),
                       top_k=given(args.top_k, "top_k", 8),
                       experts=given(args.experts, "experts", 16),
                       dtype=given(args.dtype, "dtype", "bfloat16"),
                       fp8=given(args.fp8, "fp8", False), systems=tuple(systems),
                       iters=args.iters or 100, warmup=args.warmup, block=args.block,
                       routing=args.routing, expert=args.expert,
                       workers=args.workers, seed=args.seed, pin=args.pin)


def _console():
    from rich.console import Console

    # piped output (make demo | tee, CI logs) gets wide tables instead of 80 columns
    return Console(width=None if sys.stdout.isatty() else 150)


def _run_and_report(cfg: BenchConfig, out_dir: Path, timeout_s: float, console) -> int:
    from ubep.bench.report import print_report, save
    from ubep.bench.run import run_bench

    with console.status("benchmarking ...") as status:
        res = run_bench(cfg, timeout_s=timeout_s,
                        progress=lambda msg: status.update(f"benchmarking {msg}"))
    print_report(res, console)
    paths = save(res, out_dir)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _bench_main(args) -> int:
    if args.hosts is not None:
        return _hosts_main(args)
    if args.sync_sweep:
        mod = _sync_sweep_module()
        if mod is None:
            raise SystemExit("ubep bench --sync-sweep: ubep.bench.sync_sweep is not built yet")
        return int(mod.run_sync_sweep_command(args) or 0)
    try:
        cfg = _config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"ubep bench: {e}") from None
    out = Path(args.out or Path("results/bench") / time.strftime("%Y%m%d-%H%M%S"))
    return _run_and_report(cfg, out, args.timeout, _console())


def _hosts_main(args) -> int:
    """`ubep bench --hosts H`: hybrid vs torch on emulated hosts (`ubep.bench.multihost`)."""
    from ubep.bench.multihost import MultihostConfig, run

    kw = {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
          "link_rate": args.link_rate, "seed": args.seed, "timeout_s": args.timeout}
    if args.tokens:
        kw["batches"] = tuple(args.tokens)
    if args.hidden:
        kw["hidden"] = args.hidden[0]
    if args.top_k:
        kw["top_k"] = args.top_k
    if args.iters:
        kw["rounds"] = max(1, -(-args.iters // MultihostConfig.block))
    if args.hosts < 2:
        raise SystemExit(f"ubep bench: --hosts {args.hosts} must be >= 2")
    out = Path(args.out or Path("results/multihost") / time.strftime("%Y%m%d-%H%M%S"))
    run(MultihostConfig(**kw), out)
    return 0


def demo_config(iters: int = 40) -> BenchConfig:
    """The demo's bench: DeepSeek-like rows (hidden 7168, bf16, top-8), 2 ranks, 16 experts."""
    from ubep.bench.run import mpi_unavailable_reason

    systems = [*DEFAULT_SYSTEMS, "agrs"]
    if mpi_unavailable_reason() is None:
        systems.append("mpi")
    return BenchConfig(ranks=(2,), hiddens=(7168,), batches=DEMO_BATCHES, top_k=8,
                       experts=16, dtype="bfloat16", systems=tuple(systems), iters=iters,
                       warmup=5)


def _demo_main(args) -> int:
    from rich.rule import Rule

    console = _console()
    out = Path(args.out)
    # -- step 1: the real runtime, side by side with gloo and MPI, against the copy bound --
    console.print(Rule("ubep demo 1/2: dispatch+combine on this host"))
    rc = _run_and_report(demo_config(args.iters), out / "bench", 600.0, console)
    # -- step 2: the simulator's short reproduction of the paper on a modelled CM384 --
    console.print(Rule("ubep demo 2/2: simulated superpods (short reproduction, cm384)"))
    from rich.markdown import Markdown

    from ubep.sim.reproduce import run as reproduce

    report = reproduce(out / "sim", short=True)
    text = report.read_text()
    start = text.find("## Dispatch latency")
    end = text.find("\n## ", start + 1)
    if start >= 0:
        console.print(Markdown(text[start:end if end > 0 else None]))
    console.print(f"full report with every experiment: {report}")
    return rc
