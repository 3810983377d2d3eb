"""`ubep reproduce`: the paper's experiments on the calibrated model, as CSV + PNG + report.

Every experiment lists its simulations (jobs) first, so one progress bar covers the whole
run; then it writes `<name>.csv`, `<name>.png` and a section of `report.md`. Numbers that
were calibration targets are labelled "fitted", everything else "predicted".
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ubep.sim.api import SimConfig, execute, prepare
from ubep.sim.metrics import SimResult
from ubep.sim.params import CostParams, calibrated, load_calibration

# Table 4 of the paper (cm384, 128 tokens x top-8, hidden 7168, 1 byte, one expert per rank)
PAPER_TABLE4 = {16: (103, 73), 64: (139, 101), 256: (151, 112)}
TABLE4 = dict(tokens_per_rank=128, hidden=7168, top_k=8, bytes_per_element=1)
FITTED_RANKS = (16, 64, 256)


@dataclass(frozen=True)
class Job:
    key: tuple
    ranks: int
    config: SimConfig
    #: diagnostics only (never a prediction): every link (ports and uplinks) this many times
    #: the calibrated bandwidth, all else as fitted
    link_scale: float = 1.0


@dataclass
class Experiment:
    name: str
    title: str
    jobs: list[Job]
    finish: Callable[[dict, Path], str]   # results by key, out dir -> markdown section


def _cfg(mode: str = "ubep", **kw) -> SimConfig:
    base = dict(TABLE4)
    base.update(kw)
    sched = base.pop("schedule", "static" if mode == "bsp" else "hierarchical")
    return SimConfig(mode=mode, schedule=sched, **base)


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _md_table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- experiments -------------------------------------------------------------------------

def exp_table4(short: bool, topo: str) -> Experiment:
    ranks = (16, 32, 64) if short else (16, 32, 64, 128, 256)
    jobs = [Job((r, m), r, _cfg(m)) for r in ranks for m in ("bsp", "ubep")]

    def finish(res: dict, out: Path) -> str:
        rows = []
        for r in ranks:
            b, u = res[(r, "bsp")], res[(r, "ubep")]
            paper = PAPER_TABLE4.get(r) if topo == "cm384" else None
            rows.append({"ranks": r, "label": "fitted" if paper else "predicted",
                         "bsp_us": b.latency_us, "bsp_GBps": b.bandwidth_GBps,
                         "ubep_us": u.latency_us, "ubep_GBps": u.bandwidth_GBps,
                         "count_workers": u.count_workers,
                         "speedup": b.latency_us / u.latency_us,
                         "paper_bsp_us": paper[0] if paper else "",
                         "paper_ubep_us": paper[1] if paper else ""})
        _write_csv(out / "table4.csv", rows)
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(ranks, [x["bsp_us"] for x in rows], "o-", label="BSP (CANN-EP) model")
        ax.plot(ranks, [x["ubep_us"] for x in rows], "s-", label="UBEP model")
        if topo == "cm384":
            pr = [r for r in ranks if r in PAPER_TABLE4]
            ax.plot(pr, [PAPER_TABLE4[r][0] for r in pr], "kx", label="paper BSP")
            ax.plot(pr, [PAPER_TABLE4[r][1] for r in pr], "k+", label="paper UBEP")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel("dispatch latency (us)")
        ax.set_title(f"Table 4 analogue ({topo})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "table4.png", dpi=110)
        plt.close(fig)
        return ("UBEP runs with the model's own count-worker choice (Eq. 4 on the calibrated "
                "constants); fitted = a calibration target.\n\n"
                + _md_table(rows, ["ranks", "label", "bsp_us", "bsp_GBps", "ubep_us",
                                   "ubep_GBps", "count_workers", "speedup", "paper_bsp_us",
                                   "paper_ubep_us"]))

    return Experiment("table4", "Dispatch latency and bandwidth vs ranks, BSP vs UBEP "
                      "(Table 4)", jobs, finish)


def exp_fig3b(short: bool, topo: str) -> Experiment:
    cores = (8, 16, 24, 32, 48)
    R = int(load_calibration().get("fig3b_ranks", 16))   # the rank count the fit assumed
    jobs = [Job(("c", c), R, _cfg("bsp", workers=c)) for c in cores]
    paper = dict(zip(cores, (100.0, 76.7, 57.6, 45.6, 31.1)))

    def finish(res: dict, out: Path) -> str:
        t8 = res[("c", 8)].phases_us["token_send"]
        rows = []
        for c in cores:
            t = res[("c", c)].phases_us["token_send"]
            rows.append({"cores": c, "label": "fitted" if topo == "cm384" else "predicted",
                         "token_send_us": t, "efficiency_pct": 100 * t8 * 8 / (t * c),
                         "paper_efficiency_pct": paper[c] if topo == "cm384" else ""})
        _write_csv(out / "fig3b.csv", rows)
        plt = _plt()
        fig, ax1 = plt.subplots(figsize=(6, 4))
        ax1.plot(cores, [r["efficiency_pct"] for r in rows], "o-", label="model efficiency")
        if topo == "cm384":
            ax1.plot(cores, [paper[c] for c in cores], "kx", label="paper")
        ax1.set_xlabel("vector cores")
        ax1.set_ylabel("efficiency vs 8 cores (%)")
        ax2 = ax1.twinx()
        ax2.plot(cores, [r["token_send_us"] for r in rows], "g--", label="latency")
        ax2.set_ylabel("Token-Sending latency (us)")
        ax1.legend(loc="upper right")
        ax1.set_title(f"Token-Sending vs cores, BSP, {R} ranks ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig3b.png", dpi=110)
        plt.close(fig)
        return _md_table(rows, ["cores", "label", "token_send_us", "efficiency_pct",
                                "paper_efficiency_pct"])

    return Experiment("fig3b", "Token-Sending latency and efficiency vs cores (Fig. 3b)",
                      jobs, finish)


def exp_fig7(short: bool, topo: str) -> Experiment:
    R = 16 if short else 128
    batches = (8, 128) if short else (8, 16, 32, 64, 128)
    ranks = (16, 32) if short else (64, 128, 256)
    experts = (R, 2 * R) if short else (128, 256)
    jobs = [Job(("b", b, m), R, _cfg(m, tokens_per_rank=b)) for b in batches
            for m in ("bsp", "ubep")]
    jobs += [Job(("r", r, m), r, _cfg(m)) for r in ranks for m in ("bsp", "ubep")]
    jobs += [Job(("e", e, m), R, _cfg(m, num_experts=e)) for e in experts
             for m in ("bsp", "ubep")]

    def finish(res: dict, out: Path) -> str:
        rows = []
        for kind, vals, what in (("b", batches, "batch"), ("r", ranks, "ranks"),
                                 ("e", experts, "experts")):
            for v in vals:
                b, u = res[(kind, v, "bsp")], res[(kind, v, "ubep")]
                rows.append({"sweep": what, "value": v, "ranks": b.num_ranks,
                             "label": "predicted", "bsp_us": b.latency_us,
                             "ubep_us": u.latency_us, "speedup": b.latency_us / u.latency_us})
        _write_csv(out / "fig7.csv", rows)
        plt = _plt()
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, what in zip(axes, ("batch", "ranks", "experts")):
            sel = [r for r in rows if r["sweep"] == what]
            x = [r["value"] for r in sel]
            ax.plot(x, [r["bsp_us"] for r in sel], "o-", label="BSP")
            ax.plot(x, [r["ubep_us"] for r in sel], "s-", label="UBEP")
            ax.set_xlabel(what)
            ax.set_ylabel("dispatch latency (us)")
            ax.set_xscale("log", base=2)
            ax.legend()
        fig.suptitle(f"Latency vs batch (at {R} ranks), ranks, experts ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig7.png", dpi=110)
        plt.close(fig)
        return _md_table(rows, ["sweep", "value", "ranks", "label", "bsp_us", "ubep_us",
                                "speedup"])

    return Experiment("fig7", "Latency vs batch, ranks and experts (Fig. 7)", jobs, finish)


def exp_fig8(short: bool, topo: str) -> Experiment:
    R = 16 if short else 64
    batches = (32, 128) if short else (32, 64, 128)
    jobs = [Job(("b", b, m), R, _cfg(m, tokens_per_rank=b)) for b in batches
            for m in ("bsp", "ubep")]

    def finish(res: dict, out: Path) -> str:
        rows = []
        for b in batches:
            for m in ("bsp", "ubep"):
                r = res[("b", b, m)]
                crit = int(r.engine.extra["critical_rank"])
                per: dict[tuple[int, str], float] = {}
                for iv in r.worker_intervals(crit):
                    k = (iv.worker, iv.name)
                    per[k] = per.get(k, 0.0) + iv.duration_us
                for (w, name), d in sorted(per.items()):
                    rows.append({"batch": b, "mode": m, "rank": crit, "worker": w,
                                 "phase": name, "us": d, "label": "predicted"})
        _write_csv(out / "fig8.csv", rows)
        plt = _plt()
        fig, axes = plt.subplots(len(batches), 2, figsize=(12, 2.6 * len(batches)),
                                 squeeze=False)
        names = sorted({r["phase"] for r in rows})
        cmap = plt.get_cmap("tab20")
        for i, b in enumerate(batches):
            for j, m in enumerate(("bsp", "ubep")):
                ax = axes[i][j]
                sel = [r for r in rows if r["batch"] == b and r["mode"] == m]
                workers = sorted({r["worker"] for r in sel})
                bottom = np.zeros(len(workers))
                for c, name in enumerate(names):
                    v = np.array([sum(r["us"] for r in sel if r["worker"] == w
                                      and r["phase"] == name) for w in workers])
                    if v.any():
                        ax.bar(workers, v, bottom=bottom, color=cmap(c % 20), label=name)
                        bottom += v
                ax.set_title(f"{m.upper()} batch {b}", fontsize=9)
                ax.set_ylabel("us")
        axes[0][1].legend(fontsize=6, ncol=2, loc="upper right")
        fig.suptitle(f"Per-worker phase breakdown, slowest rank, {R} ranks ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig8.png", dpi=110)
        plt.close(fig)
        summary = []
        for b in batches:
            for m in ("bsp", "ubep"):
                r = res[("b", b, m)]
                summary.append({"batch": b, "mode": m, "latency_us": r.latency_us,
                                **{k: v for k, v in r.phases_us.items() if k != "launch"}})
        cols = ["batch", "mode", "latency_us"] + sorted(
            {k for s in summary for k in s} - {"batch", "mode", "latency_us"})
        return ("Phase durations on the slowest rank (UBEP phases overlap):\n\n"
                + _md_table(summary, cols))

    return Experiment("fig8", "Per-phase breakdown per worker (Fig. 8)", jobs, finish)


FIG9 = dict(ranks=64, experts=256, hot_experts=8, hot_weight=3.0)
#: routing seeds of Fig. 9 (which experts are hot and the draws); seed 0 is shown in full
FIG9_SEEDS = (0, 1, 2, 3, 4, 5)
#: diagnostic of Fig. 9: links this many times faster, so that no shared link binds
FIG9_LINK_SCALE = 4.0


def exp_fig9(short: bool, topo: str) -> Experiment:
    from ubep.sim.workload import hot_expert_ids

    scheds = ("static", "balanced", "hierarchical")
    R, E, H, W = FIG9["ranks"], FIG9["experts"], FIG9["hot_experts"], FIG9["hot_weight"]

    def cfg(s: str, seed: int) -> SimConfig:
        return replace(_cfg("ubep", num_experts=E, schedule=s, hot_experts=H, hot_weight=W,
                            routing="hot"), seed=seed)

    jobs = [Job(("s", s), R, cfg(s, 0)) for s in scheds]
    jobs += [Job(("seed", s, k), R, cfg(s, k)) for k in FIG9_SEEDS[1:] for s in scheds]
    if not short:   # which bound decides the order: the same seeds without skew, and with
        # every link 4x faster (diagnostics, labelled so; not the fitted model's prediction)
        jobs += [Job(("uniform", s, k), R, replace(cfg(s, k), routing="uniform",
                                                   hot_experts=0))
                 for k in FIG9_SEEDS for s in scheds]
        jobs += [Job(("links4", s, k), R, cfg(s, k), link_scale=FIG9_LINK_SCALE)
                 for k in FIG9_SEEDS for s in scheds]

    def finish(res: dict, out: Path) -> str:
        from ubep.plan.topology import Topology
        from ubep.sim.fabric import Fabric

        rows, summary = [], []
        r0 = res[("s", scheds[0])]
        fab = Fabric.of(Topology.preset(topo, ranks=R), calibrated(topo))
        port = float(fab.port_bw_GBps[1:].min())
        nbytes, floor = r0.ingress_bytes, r0.engine.extra["ingress_floor_us"]
        hot = hot_expert_ids(E, H, seed=r0.config.seed)
        hot_ranks = sorted({int(x) // (E // R) for x in hot})
        for s in scheds:
            r = res[("s", s)]
            e = r.engine
            sel = e.iv_name == "token_send"
            lat = _token_send_us(r)
            for rk, w, v in zip(e.iv_rank[sel], e.iv_worker[sel], lat):
                rows.append({"schedule": s, "rank": int(rk), "worker": int(w), "us": float(v),
                             "label": "predicted"})
            summary.append({"schedule": s, "label": "predicted", "max_us": float(lat.max()),
                            "mean_us": float(lat.mean()), "min_us": float(lat.min()),
                            "dispatch_us": r.latency_us,
                            "max_ingress_floor_us": float(floor.max())})
        _write_csv(out / "fig9.csv", rows)
        _write_csv(out / "fig9_ingress.csv", [
            {"rank": i, "ingress_bytes": int(nbytes[i]), "ingress_floor_us": float(floor[i]),
             "hosts_hot_expert": i in hot_ranks, "label": "predicted"} for i in range(R)])
        plt = _plt()
        fig, ax = plt.subplots(figsize=(8, 4))
        for s in scheds:
            v = sorted(x["us"] for x in rows if x["schedule"] == s)
            ax.plot(np.linspace(0, 1, len(v)), v, "-", label=f"{s} (max "
                    f"{[m['max_us'] for m in summary if m['schedule'] == s][0]:.1f} us)")
        ax.axhline(float(floor.max()), color="k", ls=":", label="max ingress floor")
        ax.set_xlabel("token workers of all ranks (sorted)")
        ax.set_ylabel("Token-Sending time (us)")
        ax.set_title(f"{R} ranks, {E} experts, top-8, {H} hot experts x{W:g} ({topo})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fig9.png", dpi=110)
        plt.close(fig)
        slowest = min(m["max_us"] for m in summary)
        note = (f"Skew: {H} of {E} experts (ids {', '.join(map(str, hot))}, on ranks "
                f"{', '.join(map(str, hot_ranks))}) are {W:g}x likelier; expert e lives on rank "
                f"e // {E // R}. Static = CANN's ownership: each core a contiguous run of the "
                f"rank's tokens (all their (token, k) pairs, in order). Per-rank ingress: "
                f"max {nbytes.max() / 1e6:.2f} MB, mean {nbytes.mean() / 1e6:.2f} MB; ingress "
                f"floor (max bytes / {port:.0f} GB/s) {floor.max():.1f} us, "
                f"{'below' if floor.max() < slowest else 'NOT below'} the best schedule's max "
                f"per-worker Token-Sending time ({slowest:.1f} us); the boards' uplink/downlink "
                f"floor (rows crossing the second switch tier at the fitted uplink bandwidth) "
                f"{r0.uplink_floor_us:.1f} us, "
                f"{'below' if r0.uplink_floor_us < slowest else 'NOT below'} it. Ingress per "
                f"rank: fig9_ingress.csv.\n\n")
        # the same experiment over routing seeds: is the order robust, and how close to the
        # ingress floor does each seed run?
        def seed_rows(kind: str | None, label: str) -> list[dict]:
            rows_ = []
            for k in FIG9_SEEDS:
                got = {s: (res[("s", s)] if k == 0 else res[("seed", s, k)]) if kind is None
                       else res[(kind, s, k)] for s in scheds}
                mx = {s: float(_token_send_us(got[s]).max()) for s in scheds}
                ing, up = got[scheds[0]].ingress_floor_us, got[scheds[0]].uplink_floor_us
                rows_.append({"seed": k, **{f"{s}_max_us": mx[s] for s in scheds},
                              "max_ingress_floor_us": ing, "max_uplink_floor_us": up,
                              "margin_us": min(mx.values()) - max(ing, up),
                              "ordered": mx["static"] > mx["balanced"] > mx["hierarchical"],
                              "label": label})
            return rows_

        seeds = seed_rows(None, "predicted")
        _write_csv(out / "fig9_seeds.csv", seeds)
        n_ord = sum(r["ordered"] for r in seeds)
        mean = {s: float(np.mean([r[f"{s}_max_us"] for r in seeds])) for s in scheds}
        cols = ["seed", *(f"{s}_max_us" for s in scheds), "max_ingress_floor_us",
                "max_uplink_floor_us", "margin_us", "ordered"]
        robust = (f"\n\nThe same experiment over routing seeds {', '.join(map(str, FIG9_SEEDS))} "
                  f"(fig9_seeds.csv): static > balanced > hierarchical in {n_ord} of "
                  f"{len(seeds)}; mean max per-worker Token-Sending "
                  + " / ".join(f"{s} {mean[s]:.1f}" for s in scheds) + " us. margin: the "
                  "best schedule's max minus the higher floor (a hot rank's ingress, or a "
                  "board's uplink/downlink: the rows of the second switch tier at the fitted "
                  "uplink bandwidth).\n\n")
        text = (note + _md_table(summary, ["schedule", "label", "max_us", "mean_us", "min_us",
                                           "dispatch_us", "max_ingress_floor_us"])
                + robust + _md_table(seeds, cols))
        if ("uniform", scheds[0], FIG9_SEEDS[0]) in res:
            diag = (seed_rows("uniform", "diagnostic: uniform routing")
                    + seed_rows("links4", f"diagnostic: links x{FIG9_LINK_SCALE:g}"))
            _write_csv(out / "fig9_diagnostics.csv", diag)
            count = {lab: sum(r["ordered"] for r in diag if r["label"] == lab)
                     for lab in dict.fromkeys(r["label"] for r in diag)}
            text += ("\n\nDiagnostics, NOT predictions (fig9_diagnostics.csv): which bound "
                     "decides the order. The same seeds with uniform routing (fitted "
                     "constants), and with the skew but every link (ports and uplinks) "
                     f"{FIG9_LINK_SCALE:g}x the calibrated bandwidth, everything else as "
                     "fitted. Ordered: " + "; ".join(f"{lab} {n} of {len(FIG9_SEEDS)}"
                                                     for lab, n in count.items())
                     + ".\n\n" + _md_table(diag, ["label", *cols]))
        return text

    return Experiment("fig9", "Per-worker Token-Sending time with hot experts, by "
                      "scheduler (Fig. 9)", jobs, finish)


def _token_send_us(r: SimResult) -> np.ndarray:
    """Per token worker (all ranks): Token-Sending time = role start -> its last store issued."""
    e = r.engine
    sel = e.iv_name == "token_send"
    return e.iv_end[sel] - e.iv_start[sel]


def exp_fig10(short: bool, topo: str) -> Experiment:
    sizes = (10, 10000) if short else (10, 30, 100, 300, 1000, 3000, 10000)
    ranks = (16,) if short else (16, 32, 64)
    syncs = ("sw", "tff", "dc", "sp")
    jobs = [Job((r, s, y), r, _cfg("ubep", tokens_per_rank=8, hidden=s, sync=y))
            for r in ranks for s in sizes for y in syncs]

    def finish(res: dict, out: Path) -> str:
        def deliver(r: SimResult) -> float:
            e = r.engine   # issue start -> the receiver knows the row is there
            return float(np.mean(e.row_visible - e.row_issue_start))

        rows = [{"ranks": r, "bytes": s, "sync": y, "label": "predicted",
                 "latency_us": res[(r, s, y)].latency_us,
                 "row_delivery_us": deliver(res[(r, s, y)]),
                 "payload_efficiency": res[(r, s, y)].payload_efficiency}
                for r in ranks for s in sizes for y in syncs]
        _write_csv(out / "fig10.csv", rows)
        plt = _plt()
        fig, axes = plt.subplots(2, len(ranks), figsize=(4.5 * len(ranks), 7), squeeze=False)
        for i, r in enumerate(ranks):
            for y in syncs:
                axes[0][i].plot(sizes, [res[(r, s, y)].latency_us for s in sizes], "o-", label=y)
                axes[1][i].plot(sizes, [deliver(res[(r, s, y)]) for s in sizes], "o-", label=y)
            for ax, what in ((axes[0][i], "dispatch latency (us)"),
                             (axes[1][i], "mean row delivery (us)")):
                ax.set_xscale("log")
                ax.set_xlabel("bytes per token")
                ax.set_ylabel(what)
                ax.set_title(f"{r} ranks")
                ax.legend()
        fig.suptitle(f"Sync variants vs data size, 8 tokens x top-8 ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig10.png", dpi=110)
        plt.close(fig)
        piv = []
        for r in ranks:
            for s in sizes:
                piv.append({"ranks": r, "bytes": s,
                            **{y: res[(r, s, y)].latency_us for y in syncs},
                            **{f"{y} delivery": deliver(res[(r, s, y)]) for y in syncs}})
        return ("Dispatch latency (us) and mean per-row delivery time (issue start to the "
                "receiver seeing the row, us):\n\n"
                + _md_table(piv, ["ranks", "bytes", *syncs, *[f"{y} delivery" for y in syncs]]))

    return Experiment("fig10", "sw / tff / dc / sp vs data size (Fig. 10)", jobs, finish)


def exp_fig12(short: bool, topo: str) -> Experiment:
    ranks = (16, 32) if short else (16, 32, 64, 128, 256)
    batches = (32, 128)
    topks = (2, 4, 8)
    R = 16 if short else 64
    jobs = [Job(("b", b, r, m), r, _cfg(m, tokens_per_rank=b)) for b in batches
            for r in ranks for m in ("bsp", "ubep")]
    jobs += [Job(("k", k, m), R, _cfg(m, top_k=k)) for k in topks for m in ("bsp", "ubep")]

    def finish(res: dict, out: Path) -> str:
        rows = []
        for b in batches:
            for r in ranks:
                x, y = res[("b", b, r, "bsp")], res[("b", b, r, "ubep")]
                fitted = topo == "cm384" and b == 128 and r in FITTED_RANKS
                rows.append({"sweep": f"batch {b}", "ranks": r, "top_k": 8,
                             "label": "fitted" if fitted else "predicted",
                             "bsp_us": x.latency_us, "ubep_us": y.latency_us,
                             "speedup": x.latency_us / y.latency_us})
        for k in topks:
            x, y = res[("k", k, "bsp")], res[("k", k, "ubep")]
            rows.append({"sweep": "top-k", "ranks": R, "top_k": k, "label": "predicted",
                         "bsp_us": x.latency_us, "ubep_us": y.latency_us,
                         "speedup": x.latency_us / y.latency_us})
        _write_csv(out / "fig12_13.csv", rows)
        plt = _plt()
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, b in zip(axes, batches):
            sel = [r for r in rows if r["sweep"] == f"batch {b}"]
            ax.plot(ranks, [r["bsp_us"] for r in sel], "o-", label="BSP")
            ax.plot(ranks, [r["ubep_us"] for r in sel], "s-", label="UBEP")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("ranks")
            ax.set_ylabel("latency (us)")
            ax.set_title(f"batch {b}")
            ax.legend()
        sel = [r for r in rows if r["sweep"] == "top-k"]
        axes[2].plot(topks, [r["bsp_us"] for r in sel], "o-", label="BSP")
        axes[2].plot(topks, [r["ubep_us"] for r in sel], "s-", label="UBEP")
        axes[2].set_xlabel("top-k")
        axes[2].set_title(f"{R} ranks, batch 128")
        axes[2].legend()
        fig.suptitle(f"Batch 32/128 across ranks, and top-k ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig12_13.png", dpi=110)
        plt.close(fig)
        return _md_table(rows, ["sweep", "ranks", "top_k", "label", "bsp_us", "ubep_us",
                                "speedup"])

    return Experiment("fig12_13", "Batch 32 and 128 across ranks; top-k 2/4/8 (Figs. 12-13)",
                      jobs, finish)


def exp_fig14(short: bool, topo: str) -> Experiment:
    ranks = (32,) if short else (64, 128, 256)
    batches = (8, 128) if short else (8, 16, 32, 64, 128)
    ncs = (1, 2, 4, 8) if short else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40)
    jobs = [Job((r, b, c), r, _cfg("ubep", tokens_per_rank=b, count_workers=c))
            for r in ranks for b in batches for c in (0,) + ncs]   # 0: the model's choice

    def finish(res: dict, out: Path) -> str:
        rows, best = [], []
        for r in ranks:
            for b in batches:
                lat = [res[(r, b, c)].latency_us for c in ncs]
                for c, v in zip(ncs, lat):
                    rows.append({"ranks": r, "batch": b, "count_workers": c, "latency_us": v,
                                 "label": "predicted"})
                k = int(np.argmin(lat))
                model = res[(r, b, 0)].count_workers
                best.append({"ranks": r, "batch": b, "best_count_workers": ncs[k],
                             "best_us": lat[k], "cost_model_choice": model,
                             "cost_model_us": res[(r, b, 0)].latency_us,
                             "label": "predicted"})
        _write_csv(out / "fig14.csv", rows)
        _write_csv(out / "fig14_best.csv", best)
        plt = _plt()
        grid = np.array([[res[(r, b, c)].latency_us for c in ncs] for r in ranks
                         for b in batches])
        norm = grid / grid.min(axis=1, keepdims=True)
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(grid) + 1.5))
        im = ax.imshow(norm, aspect="auto", cmap="viridis_r", vmin=1.0, vmax=min(norm.max(), 2))
        ax.set_xticks(range(len(ncs)), [str(c) for c in ncs])
        ax.set_yticks(range(len(grid)), [f"{r} ranks, batch {b}" for r in ranks
                                         for b in batches], fontsize=7)
        for i, row in enumerate(best):
            ax.plot(ncs.index(row["best_count_workers"]), i, "w*", ms=9)
            if row["cost_model_choice"] in ncs:
                ax.plot(ncs.index(row["cost_model_choice"]), i, "rx", ms=7)
        ax.set_xlabel("count workers (white star: best; red x: cost model's choice)")
        fig.colorbar(im, label="latency / row minimum")
        ax.set_title(f"Count-worker sweep ({topo})")
        fig.tight_layout()
        fig.savefig(out / "fig14.png", dpi=110)
        plt.close(fig)
        grid_rows = [{"ranks": r, **{f"batch {b}": f"{x['best_count_workers']} "
                                    f"({x['cost_model_choice']})"
                                    for b in batches for x in best
                                    if x["ranks"] == r and x["batch"] == b}} for r in ranks]
        return ("Best count-worker (CalCumSum group) number per (ranks, batch), the model's "
                f"Eq. 4 choice in parentheses; swept: {', '.join(map(str, ncs))}.\n\n"
                + _md_table(grid_rows, ["ranks", *[f"batch {b}" for b in batches]]) + "\n\n"
                + _md_table(best, ["ranks", "batch", "best_count_workers", "best_us",
                                   "cost_model_choice", "cost_model_us"]))

    return Experiment("fig14", "Count-worker sweep, best per row vs the cost model "
                      "(Fig. 14, Appendix A)", jobs, finish)


EXPERIMENTS = (exp_table4, exp_fig3b, exp_fig7, exp_fig8, exp_fig9, exp_fig10, exp_fig12,
               exp_fig14)


def run(out_dir: str | Path, short: bool = True, topology: str = "cm384",
        params: CostParams | None = None, progress: bool = True) -> Path:
    """Run every experiment into `out_dir`; returns the path of `report.md`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = params or calibrated(topology)
    exps = [f(short, topology) for f in EXPERIMENTS]
    total = sum(len(e.jobs) for e in exps)
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    done: dict[tuple, SimResult] = {}
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[progress.description]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, disable=not progress, transient=False) as bar:
        task = bar.add_task("reproduce", total=total)
        for e in exps:
            bar.update(task, description=f"{e.name:>9}")
            res: dict = {}
            for j in e.jobs:
                k = (j.ranks, j.config, j.link_scale)   # experiments share some runs
                if k not in done:
                    done[k] = _simulate(topology, j, params)
                res[j.key] = done[k]
                bar.advance(task)
            results[e.name] = res
    sections = [(e, e.finish(results[e.name], out)) for e in exps]
    wall = time.perf_counter() - t0
    report = _report(out, sections, topology, short, params, wall, len(done))
    (out / "config.json").write_text(json.dumps({
        "topology": topology, "short": short, "params": params.__dict__,
        "jobs": total, "simulations": len(done), "wall_s": round(wall, 1)}, indent=2))
    return report


def _simulate(topology: str, job: Job, params: CostParams) -> SimResult:
    cfg = job.config
    if job.link_scale != 1.0:
        params = params.with_(port_bw_scale=params.port_bw_scale * job.link_scale)
    if cfg.num_experts == 0:
        cfg = replace(cfg, num_experts=job.ranks)
    return execute(prepare(topology, cfg, ranks=job.ranks, params=params), params)


def _report(out: Path, sections, topology: str, short: bool, params: CostParams,
            wall: float, total: int) -> Path:
    cal = load_calibration()
    lines = [f"# ubep simulator: the paper's experiments on `{topology}`",
             "",
             f"{'Short' if short else 'Full'} run: {total} simulations in {wall:.1f} s. "
             "Model: `ubep.sim` with the constants of `ubep/sim/data/calibration.json` "
             f"(fitted {cal.get('created', '?')}, rms relative residual "
             f"{cal.get('rms_relative_residual', float('nan')):.3f}). Labels: **fitted** = a "
             "calibration target (the paper's points in ubep/sim/data/paper_public.toml); "
             "**predicted** = "
             "not fitted. Workload unless stated: 128 tokens x top-8 per rank, hidden 7168, "
             "1 byte per element, one expert per rank, uniform routing, seed 0.",
             "",
             "Cost constants used:",
             "",
             "| constant | value | meaning |", "|---|---|---|"]
    helps = CostParams.help()
    for k, v in params.__dict__.items():
        lines.append(f"| {k} | {v:.4g} | {helps[k]} |")
    for e, md in sections:
        lines += ["", f"## {e.title}", "", f"![{e.name}]({e.name}.png)", "", md]
    p = out / "report.md"
    p.write_text("\n".join(lines) + "\n")
    return p
