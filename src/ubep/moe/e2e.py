"""End-to-end EP decoding on P processes: per-step latency (TPOT) per communication backend.

`e2e_rank` runs on every rank (through `ubep.testing.run_ranks`): it builds the model,
keeps an unsplit copy (the reference, and the "unsplit" timing row), converts the model to
EP and decodes the same prompts once per backend, the decoders taking turns step by step.
`summarize` turns the ranks' results into TPOT percentiles and the share of a step spent in
dispatch+combine; `plot_tpot` draws the per-token latency normalised to gloo.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ubep.moe.convert import buffer_for, convert_to_ep, ep_layers, set_buffer
from ubep.moe.decode import DecodeResult, GreedyDecoder
from ubep.moe.models import build_model, make_prompts

#: backend label -> (Buffer backend, mode, direct). "gloo" is the torch backend over the gloo
#: group; "shm-direct" writes each row once, straight to its place (`Buffer(direct=True)`);
#: "shm-owned" is what `Buffer(backend="auto")` gives on one host (`direct="owned"`).
BACKEND_SPECS: dict[str, tuple[str, str, bool | str]] = {
    "gloo": ("torch", "ubep", False),
    "shm-bsp": ("shm", "bsp", False),
    "shm-ubep": ("shm", "ubep", False),
    "shm-direct": ("shm", "ubep", True),
    "shm-owned": ("shm", "ubep", "owned"),
}
UNSPLIT = "unsplit"  # label of the reference run: each rank runs all experts, no communication
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def available_backends() -> list[str]:
    """Backend labels whose Buffer backend is registered in this build."""
    from ubep.runtime import backend_names

    names = backend_names()
    return [name for name, (backend, *_) in BACKEND_SPECS.items() if backend in names]


@dataclass(frozen=True)
class E2EConfig:
    """What one end-to-end run decodes, and through which backends."""

    arch: str = field(metadata={"help": "qwen3 | deepseek"})
    size: str = field(default="tiny", metadata={"help": "model preset: tiny | small"})
    batches: tuple[int, ...] = field(default=(1,), metadata={"help": "sequences per rank"})
    steps: int = field(default=16, metadata={"help": "decode steps (tokens) per sequence"})
    prompt_len: int = field(default=8, metadata={"help": "prompt tokens"})
    backends: tuple[str, ...] = field(default=("gloo",), metadata={"help": "BACKEND_SPECS keys"})
    seed: int = field(default=0, metadata={"help": "weights and prompts seed"})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16"})
    reference: bool = field(default=True, metadata={"help": "decode with the unsplit model"})
    keep_logits: bool = field(default=False, metadata={"help": "return per-step logits"})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads per rank"})
    timeout_s: float = field(default=60.0, metadata={"help": "Buffer wait deadline"})
    buffer_options: tuple[tuple[str, object], ...] = field(
        default=(), metadata={"help": "extra Buffer keyword arguments (sync, workers, ...)"})

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(_DTYPES)}")
        for b in self.backends:
            if b not in BACKEND_SPECS:
                raise ValueError(f"backend {b!r} is not one of {', '.join(BACKEND_SPECS)}")
        if not self.batches or any(int(b) < 1 for b in self.batches):
            raise ValueError(f"batches={self.batches!r} must be positive sequence counts")
        if self.steps < 1 or self.prompt_len < 1:
            raise ValueError(f"steps={self.steps} and prompt_len={self.prompt_len} must be >= 1")


@dataclass(frozen=True)
class RankRun:
    """One rank's decode of one batch through one backend (or the unsplit model)."""

    backend: str
    batch: int
    result: DecodeResult


@dataclass(frozen=True)
class RankReport:
    """What `e2e_rank` returns: the runs, and parameter counts before/after conversion."""

    rank: int
    params_full: int
    params_ep: int
    local_experts_per_layer: list[int]
    num_experts: int
    runs: list[RankRun]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def e2e_rank(rank: int, world_size: int, cfg: E2EConfig) -> RankReport:
    """Run `cfg` on this rank (call through `run_ranks`; needs the default process group).

    For each batch size, one decoder per backend (and one for the unsplit model) decode the
    same prompts taking turns step by step, starting with a different one each step, so
    every backend sees the same drift of host load: on a shared host this matters more than
    any per-backend warmup.
    """
    torch.set_num_threads(cfg.threads)
    model = build_model(cfg.arch, cfg.size, seed=cfg.seed, dtype=_DTYPES[cfg.dtype])
    params_full = count_params(model)
    reference = copy.deepcopy(model) if cfg.reference else None
    prompts = {b: make_prompts(model.config.vocab_size, b, cfg.prompt_len, seed=cfg.seed,
                               rank=rank) for b in cfg.batches}
    buffers: dict[str, object] = {}
    runs: list[RankRun] = []
    try:
        for name in cfg.backends:
            backend, mode, direct = BACKEND_SPECS[name]
            options = dict(cfg.buffer_options)
            if direct:
                options["direct"] = direct
            buffers[name] = buffer_for(
                model, max_tokens_per_rank=max(cfg.batches) * cfg.prompt_len, backend=backend,
                mode=mode, timeout_s=cfg.timeout_s, **options)
        if buffers:
            convert_to_ep(model, next(iter(buffers.values())))
        for b in cfg.batches:
            decoders: dict[str, tuple[GreedyDecoder, object]] = {}
            if reference is not None:
                decoders[UNSPLIT] = (GreedyDecoder(reference, prompts[b],
                                                   keep_logits=cfg.keep_logits), None)
            for name, buf in buffers.items():
                decoders[name] = (GreedyDecoder(model, prompts[b], keep_logits=cfg.keep_logits),
                                  buf)
            order = list(decoders)
            for i in range(-1, cfg.steps):      # -1: the prefills
                for k in range(len(order)):
                    dec, buf = decoders[order[(max(i, 0) + k) % len(order)]]
                    if buf is not None:
                        set_buffer(model, buf)
                    dec.prefill() if i < 0 else dec.step()
                    # untimed: every measured step starts with the ranks aligned, as in
                    # lockstep decoding; else a step after an unsplit one (no collective)
                    # would absorb the ranks' drift as "comm"
                    dist.barrier()
            runs += [RankRun(name, b, dec.result()) for name, (dec, _) in decoders.items()]
    finally:
        for buf in buffers.values():
            buf.close()
    return RankReport(rank=rank, params_full=params_full, params_ep=count_params(model),
                      local_experts_per_layer=[m.num_local_experts for m in ep_layers(model)],
                      num_experts=ep_layers(model)[0].num_experts if buffers else 0, runs=runs)


@dataclass(frozen=True)
class TPOTSummary:
    """Per-token latency of one (arch, batch, backend) over the measured steps."""

    arch: str
    batch: int
    backend: str
    steps: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    comm_p50_ms: float         # median over steps of the time in dispatch+combine
    experts_p50_ms: float      # median over steps of the time in the local routed experts
    comm_share: float          # median over steps of (dispatch+combine) / step time
    norm_p50: float | None     # p50 / gloo's p50 (None without a gloo run)
    latencies_ms: list[float]  # per measured step: the slowest rank's step time


def step_latencies(reports: list[RankReport], backend: str, batch: int,
                   warmup: int) -> dict[str, np.ndarray]:
    """Per measured step: "latency", the slowest rank's step time (s); "comm" and "experts",
    the mean over ranks of the time in dispatch+combine and in the local experts (s);
    "share", the mean over ranks of comm / step time."""
    runs = [next(r.result for r in rep.runs if r.backend == backend and r.batch == batch)
            for rep in reports]
    step = np.stack([r.step_s.numpy() for r in runs])[:, warmup:]
    comm = np.stack([r.comm_s.numpy() for r in runs])[:, warmup:]
    experts = (np.stack([r.experts_s.numpy() for r in runs])[:, warmup:]
               if all(r.experts_s is not None for r in runs) else np.zeros_like(comm))
    return {"latency": step.max(axis=0), "comm": comm.mean(axis=0),
            "experts": experts.mean(axis=0), "share": (comm / step).mean(axis=0)}


def summarize(arch: str, reports: list[RankReport], warmup: int = 2) -> list[TPOTSummary]:
    """TPOT P50/P99 and communication share per (batch, backend) from all ranks' reports."""
    keys = list(dict.fromkeys((r.backend, r.batch) for r in reports[0].runs))
    out: list[TPOTSummary] = []
    gloo_p50 = {}
    for backend, batch in keys:
        per_step = step_latencies(reports, backend, batch, warmup)
        lat = per_step["latency"]
        if len(lat) == 0:
            raise ValueError(f"warmup={warmup} leaves no measured step")
        p50 = float(np.percentile(lat, 50)) * 1e3
        if backend == "gloo":
            gloo_p50[batch] = p50
        out.append(TPOTSummary(
            arch=arch, batch=batch, backend=backend, steps=len(lat), p50_ms=p50,
            p99_ms=float(np.percentile(lat, 99)) * 1e3, mean_ms=float(lat.mean()) * 1e3,
            comm_p50_ms=float(np.median(per_step["comm"])) * 1e3,
            experts_p50_ms=float(np.median(per_step["experts"])) * 1e3,
            comm_share=float(np.median(per_step["share"])),
            norm_p50=None,
            latencies_ms=[float(v) * 1e3 for v in lat]))
    return [TPOTSummary(**{**s.__dict__, "norm_p50": (s.p50_ms / gloo_p50[s.batch]
                                                      if s.batch in gloo_p50 else None)})
            for s in out]


def plot_tpot(summaries: list[TPOTSummary], path) -> None:
    """Violin + box plot of per-token latency normalised to gloo's median, one panel per
    (arch, batch) (the paper's Fig. 11 style). Panels without a gloo run use absolute ms."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((s.arch, s.batch) for s in summaries))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (arch, batch) in zip(axes[0], panels):
        rows = [s for s in summaries if s.arch == arch and s.batch == batch]
        gloo = next((s for s in rows if s.backend == "gloo"), None)
        scale = gloo.p50_ms if gloo else 1.0
        data = [np.asarray(s.latencies_ms) / scale for s in rows]
        pos = np.arange(1, len(rows) + 1)
        ax.violinplot(data, positions=pos, showextrema=False)
        ax.boxplot(data, positions=pos, widths=0.15, showfliers=False)
        ax.set_xticks(pos, [s.backend for s in rows], rotation=20)
        ax.set_title(f"{arch}, batch {batch}")
        ax.set_ylabel("TPOT / gloo median" if gloo else "TPOT (ms)")
        if gloo:
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
