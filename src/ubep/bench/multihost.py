"""`ubep bench --hosts H`: ubep across hosts against the torch backend, on emulated hosts.

Each host is a network namespace with its own /dev/shm (`ubep.testing.run_hosts`), the
link between hosts optionally rate-limited (`--link-rate 1gbit`). Per batch, every rank
times in turns of `block` calls (`ubep.testing.alternate`, so the host's drift hits every
line alike), after `WARM_CALLS` untimed calls of each Buffer:

* `ubep`: the default Buffer (`backend="auto"`, which picks "hybrid" across hosts);
* `torch`: `Buffer(backend="torch")`, one `all_to_all_single` per exchange over the group;
* `torch'`: a second such Buffer, the control: torch over torch' is what the host's noise
  alone makes of two identical lines in this run (an A/A test), the yardstick for a ratio
  near 1;
* `torch raw`: the torch backend's own collectives, replayed bare on the same bytes (how far
  the baseline is from its primitive);
* `ubep raw`: the hybrid backend's messages between hosts, replayed bare (isend/irecv of the
  same bytes to the same peers; in its flat mode, at small batches, the collectives it ran).

A call's time is the slowest rank's; the table gives medians and p90 over the calls, the
bytes each rank put on the network between hosts (rows only, in the hybrid backend's mode
after the timed calls), torch over ubep, and that mode (with the one before the timed
calls where it changed meanwhile).
"""

from __future__ import annotations

import csv
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LINES = ("ubep", "torch", "torch'", "ubep raw", "torch raw")
#: untimed calls of each Buffer per batch before the timed turns
WARM_CALLS = 12


@dataclass(frozen=True)
class MultihostConfig:
    """What `ubep bench --hosts` measures."""

    hosts: int = field(default=2, metadata={"help": "emulated hosts"})
    ranks_per_host: int = field(default=2, metadata={"help": "ranks on each host"})
    link_rate: str | None = field(default=None, metadata={
        "help": "each host's link rate per direction, e.g. 1gbit (tc tbf); None: unlimited"})
    batches: tuple[int, ...] = field(default=(1, 8, 32, 128), metadata={
        "help": "tokens per rank"})
    hidden: int = field(default=7168, metadata={"help": "row width (bf16)"})
    top_k: int = field(default=8, metadata={"help": "slots per token"})
    experts_per_rank: int = field(default=4, metadata={"help": "experts on each rank"})
    rounds: int = field(default=4, metadata={"help": "turns per line and batch"})
    block: int = field(default=3, metadata={"help": "calls per turn"})
    seed: int = field(default=0, metadata={"help": "routing seed"})
    timeout_s: float = field(default=1800.0, metadata={"help": "whole-run limit, seconds"})


def _replay_messages(messages: list) -> callable:
    """A call that sends and receives exactly `messages` (`Stats.extra["messages"]`) bare."""
    import torch
    import torch.distributed as dist

    bufs = [(p, torch.ones(max(s, 1), dtype=torch.uint8)[:s],
             torch.empty(max(r, 1), dtype=torch.uint8)[:r]) for p, s, r in messages]

    def call() -> None:
        works = [dist.irecv(r, src=p) for p, _, r in bufs if r.numel()]
        works += [dist.isend(s, dst=p) for p, s, _ in bufs if s.numel()]
        for w in works:
            w.wait()

    return call


def _replay_collectives(calls: list, all_to_all) -> callable:
    """A call that replays the torch backend's collectives (`replay_calls`) bare."""
    import torch.distributed as dist

    def call() -> None:
        for o, i, rs, ss in calls:
            all_to_all(dist.group.WORLD, o, i, rs, ss)

    return call


def _rank(rank: int, world: int, cfg: MultihostConfig) -> dict:
    """One rank's timings per batch and line (ns per call) and network bytes."""
    import torch

    import ubep
    from ubep.bench.systems import replay_calls
    from ubep.plan.hosts import HostLayout, rows_to_other_hosts
    from ubep.runtime.collectives import all_to_all
    from ubep.testing import alternate, make_routing, make_tokens

    torch.manual_seed(cfg.seed)
    e = cfg.experts_per_rank * world
    kw = dict(num_experts=e, hidden=cfg.hidden, max_tokens_per_rank=max(cfg.batches),
              max_top_k=cfg.top_k, timeout_s=120.0)
    ub, tb, tb2 = ubep.Buffer(**kw), ubep.Buffer(backend="torch", **kw), ubep.Buffer(
        backend="torch", **kw)
    out: dict = {"backend": ub.config.backend, "reason": ub.config.backend_reason}
    try:
        for b in cfg.batches:
            idx, w = make_routing(b, cfg.top_k, e, seed=cfg.seed * 1000 + rank)
            x = make_tokens(rank, b, cfg.hidden, torch.bfloat16, seed=cfg.seed)

            def call(buf, x=x, idx=idx, w=w):
                res = buf.dispatch(x, idx, w)
                buf.combine(res.recv_x, res.handle)
                return res.stats, buf.last_stats

            # warm: the hybrid backend settles on a mode for this batch within 10 calls
            # (a new batch bucket: 4 hierarchical calls, 4 flat ones, one more)
            for _ in range(WARM_CALLS):
                ud, uc = call(ub)
                td, tc = call(tb)
                call(tb2)
            raw_t = [_replay_collectives(replay_calls(st), all_to_all) for st in (td, tc)]
            # what the call ran: messages between hosts, or (flat mode) the collectives
            raw_u = [_replay_messages(st.extra["messages"]) if "messages" in st.extra
                     else _replay_collectives(replay_calls(st), all_to_all) for st in (ud, uc)]

            def torch_raw(raw_t=raw_t):
                for f in raw_t:
                    f()

            def ubep_raw(raw_u=raw_u):
                for f in raw_u:
                    f()

            ways = {"ubep": lambda: call(ub), "torch": lambda: call(tb),
                    "torch'": lambda: call(tb2), "ubep raw": ubep_raw, "torch raw": torch_raw}
            times = alternate(ways, cfg.rounds, block=cfg.block)
            before = ud.extra["mode"]
            ud = call(ub)[0]        # the mode the timed calls ended in, its network bytes
            lay = HostLayout.of(ub.config.hosts, e)
            torch_net = rows_to_other_hosts(lay, rank, idx.numpy(), per="rank") * (
                cfg.hidden * x.element_size())
            out[b] = {"times": times, "ubep_net": ud.bytes_sent_network,
                      "ubep_mode": ("" if before == ud.extra["mode"] else f"{before}->")
                      + ud.extra["mode"],
                      "ubep_meta": ud.extra["network_meta_bytes"], "torch_net": torch_net}
    finally:
        for buf in (ub, tb, tb2):
            buf.close()
    return out


def run(cfg: MultihostConfig, out_dir: str | Path | None = None) -> list[dict]:
    """Run the bench on emulated hosts; one row per (batch, line); printed as a table."""
    from ubep.testing import run_hosts

    t0 = time.time()
    res = run_hosts(_rank, cfg, hosts=cfg.hosts, ranks_per_host=cfg.ranks_per_host,
                    link_rate=cfg.link_rate, timeout_s=cfg.timeout_s, check_leaks=True)
    rows = []
    for b in cfg.batches:
        per = [r[b] for r in res]
        med = {}
        for line in LINES:
            t = np.max([np.asarray(p["times"][line]) for p in per], axis=0) / 1e6
            med[line] = float(np.median(t))
            rows.append({"batch": b, "line": line, "median_ms": med[line],
                         "p90_ms": float(np.percentile(t, 90)), "calls": len(t)})
        ub_net = sum(p["ubep_net"] for p in per)
        t_net = sum(p["torch_net"] for p in per)
        for r in rows[-len(LINES):]:
            r.update(torch_over_ubep=med["torch"] / med["ubep"],
                     torch_over_control=med["torch"] / med["torch'"],
                     ubep_mode=per[0]["ubep_mode"],
                     net_bytes_ubep=ub_net, net_bytes_torch=t_net,
                     net_bytes_ratio=t_net / ub_net if ub_net else float("nan"))
    _print(cfg, res[0]["backend"], res[0]["reason"], rows, time.time() - t0)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = f"multihost_{cfg.hosts}x{cfg.ranks_per_host}_{cfg.link_rate or 'unlimited'}"
        with open(out / f"{name}.csv", "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        (out / f"{name}.config.txt").write_text(repr(asdict(cfg)) + "\n")
    return rows


def _print(cfg: MultihostConfig, backend: str, reason: str, rows: list[dict],
           took_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{cfg.hosts} emulated hosts x {cfg.ranks_per_host} ranks, link "
                    f"{cfg.link_rate or 'unlimited'}, hidden {cfg.hidden} bf16, top-"
                    f"{cfg.top_k}, {cfg.experts_per_rank} experts/rank "
                    f"(dispatch+combine, slowest rank per call)")
    for col in ("batch", "line", "median ms", "p90 ms", "torch/ubep", "torch/torch'",
                "net bytes torch/ubep", "ubep mode"):
        t.add_column(col, justify="right")
    for r in rows:
        first = r["line"] == LINES[0]
        t.add_row(str(r["batch"]) if first else "", r["line"], f"{r['median_ms']:.2f}",
                  f"{r['p90_ms']:.2f}", f"{r['torch_over_ubep']:.2f}" if first else "",
                  f"{r['torch_over_control']:.2f}" if first else "",
                  f"{r['net_bytes_ratio']:.2f}" if first else "",
                  r["ubep_mode"] if first else "")
    con = Console()
    con.print(t)
    con.print(f"ubep ran backend={backend!r}: {reason}. {took_s:.0f} s.")
