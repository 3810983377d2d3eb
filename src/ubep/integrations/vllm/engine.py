"""Run vLLM engines on a tiny seeded Qwen3-MoE: one engine without EP, or DP ranks with EP.

Used by the end-to-end test (greedy tokens with ubep as the all2all backend must equal one
engine's without expert parallelism) and by `ubep e2e --engine vllm` (TPOT per setup).
Data-parallel ranks are processes set up as vLLM's offline data-parallel example does
(`VLLM_DP_*` variables); every engine is shut down explicitly before its process returns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the smallest Qwen3-MoE vLLM 0.32.0 runs on CPU (head_dim 64; 16 fails its CPU attention)
TINY_QWEN3_MOE = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    intermediate_size=256, vocab_size=512, max_position_embeddings=512,
    decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    initializer_range=0.1, rms_norm_eps=1e-6,
)


def make_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """Write a Qwen3-MoE with seeded random weights (float32 safetensors) to `path`.

    A real checkpoint, not `load_format="dummy"`: dummy initializes each (possibly sharded)
    parameter on its own, so sharded and unsharded engines would hold different weights.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**TINY_QWEN3_MOE, torch_dtype="float32")
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


@dataclass(frozen=True)
class EngineRun:
    """One setup: `dp` engines (data-parallel ranks), expert parallel through `backend`.

    `workloads` run one after another on the same engines; each is a tuple of prompts (token
    ids) given at once, prompt i to DP rank `i % dp`, each generating `max_tokens` greedily.
    """

    model: str
    dp: int = 1
    expert_parallel: bool = False
    all2all_backend: str = "ubep"
    workloads: tuple[tuple[tuple[int, ...], ...], ...] = ()
    repeats: tuple[int, ...] = ()     # runs of each workload (default 1); TPOT samples
    max_tokens: int = 8
    gpu_memory_utilization: float = 0.1
    #: KV cache per worker, bytes (None: vLLM sizes it as gpu_memory_utilization x the NUMA
    #: node's memory minus the worker's RSS, which fails where the node is small and the
    #: worker's RSS — shared-memory Buffers included — exceeds that share)
    kv_cache_bytes: int | None = 256 << 20
    max_model_len: int = 256
    timeout_s: float = 900.0
    bind_cores: bool = True           # DP rank r's compute threads on core r (see _rank_main)
    env: dict[str, str] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(run: EngineRun, rank: int, port: int, barrier, out) -> None:
    """One DP rank: build the engine, generate its share of prompts, shut down."""
    # its own process group: if the rank must be killed, vLLM's engine-core and worker
    # processes (which inherit the group) go with it instead of being orphaned
    os.setpgrp()
    try:
        # moe_layer_report is a function sent to vLLM's workers: vLLM pickles it only when
        # told to (our own processes, on this host)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        os.environ.update(run.env)
        if run.dp > 1 and run.bind_cores:
            # vLLM's "auto" binding puts every local DP rank's OMP threads on the same first
            # core (and reserves the next one): two ranks' models would share one core
            cores = sorted(os.sched_getaffinity(0))
            # (one list per local DP rank, "|"-separated, the same string on every rank)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
                str(cores[r % len(cores)]) for r in range(run.dp)))
        if run.dp > 1:
            os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank),
                              VLLM_DP_SIZE=str(run.dp), VLLM_DP_MASTER_IP="127.0.0.1",
                              VLLM_DP_MASTER_PORT=str(port))
        out.put((rank, "ok", _generate(run, rank, barrier)))
    except BaseException as e:  # the parent reports it with the rank
        import traceback

        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _generate(run: EngineRun, rank: int, barrier) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=run.model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        gpu_memory_utilization=run.gpu_memory_utilization, max_model_len=run.max_model_len,
        max_num_seqs=max([16] + [len(w) for w in run.workloads]), seed=0,
        disable_log_stats=False)    # per-request engine-core timestamps (TPOT)
    if run.kv_cache_bytes is not None:
        kwargs.update(kv_cache_memory_bytes=run.kv_cache_bytes)
    if run.expert_parallel:
        kwargs.update(enable_expert_parallel=True, all2all_backend=run.all2all_backend)
    llm = LLM(**kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=run.max_tokens, ignore_eos=True)
        engine = llm.llm_engine
        results = []
        for w, prompts in enumerate(run.workloads):
            tokens: dict[int, list[int]] = {}
            tpot_ms: list[float] = []
            for _ in range(run.repeats[w] if run.repeats else 1):
                barrier.wait(timeout=run.timeout_s)
                for i in range(rank, len(prompts), run.dp):
                    engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(prompts[i])),
                                       params)
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        if not o.finished:
                            continue
                        tokens[int(o.request_id)] = list(o.outputs[0].token_ids)
                        m = o.metrics      # engine-core timestamps of first and last token
                        if m is not None and m.num_generation_tokens > 1:
                            tpot_ms.append((m.last_token_ts - m.first_token_ts) * 1e3
                                           / (m.num_generation_tokens - 1))
            results.append({"tokens": tokens, "tpot_ms": tpot_ms})
        # a rank with no requests keeps its engine in the DP group until all are done
        barrier.wait(timeout=run.timeout_s)
        moe = llm.collective_rpc(moe_layer_report)
        barrier.wait(timeout=run.timeout_s)
        return {"workloads": results, "moe_layers": moe[0]}
    finally:
        llm.llm_engine.engine_core.shutdown()


def _kill_group(proc) -> None:
    """End a rank's process group (the rank, its engine core, its workers), if any is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        proc.join(timeout=10)
        if not proc.is_alive() and sig == signal.SIGTERM:
            time.sleep(1.0)     # let the engine core and workers act on SIGTERM


def moe_layer_report(worker) -> list[dict[str, Any]]:
    """In a vLLM worker: each MoE layer's prepare/finalize class and dispatch count."""
    report = []
    for name, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is None:
            continue
        pf = kernel.prepare_finalize
        report.append({"layer": name, "prepare_finalize": type(pf).__name__,
                       "dispatches": getattr(pf, "num_dispatches", None),
                       "combines": getattr(pf, "num_combines", None),
                       "dispatch_s": getattr(pf, "dispatch_s", None),
                       "combine_s": getattr(pf, "combine_s", None)})
    return report


def run_engines(run: EngineRun) -> dict[str, Any]:
    """Run `run`; return `{"workloads": [{"tokens": {prompt index: ids}, "tpot_ms": {rank:
    [each finished request's time per output token]}} per workload], "moe_layers": {rank:
    moe_layer_report}}`. TPOT as vLLM's benchmarks define it: (last token - first token) /
    (tokens - 1), from the engine core's timestamps."""
    for w, prompts in enumerate(run.workloads):
        if run.dp > 1 and len(prompts) < run.dp:
            raise ValueError(
                f"workload {w} has {len(prompts)} prompts for dp={run.dp}: every DP rank needs "
                f"one (vLLM's offline DP engines run no dummy forward for an idle rank, so "
                f"its peer would wait in the MoE exchange)")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(run.dp), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(run, r, port, barrier, out),
                         name=f"vllm-dp{r}") for r in range(run.dp)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + run.timeout_s
    try:
        while len(results) < run.dp:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"vLLM ranks {sorted(set(range(run.dp)) - set(results))} "
                                   f"did not finish within {run.timeout_s:.0f} s")
            try:
                rank, status, value = out.get(timeout=min(left, 5.0))
            except Exception:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead and len(results) < run.dp:
                    raise RuntimeError(f"vLLM processes {dead} died without a result") from None
                continue
            if status == "error":
                raise RuntimeError(f"vLLM DP rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            _kill_group(p)
    workloads = []
    for w in range(len(run.workloads)):
        tokens: dict[int, list[int]] = {}
        for r in results.values():
            tokens.update(r["workloads"][w]["tokens"])
        workloads.append({"tokens": tokens, "tpot_ms": {
            rank: r["workloads"][w]["tpot_ms"] for rank, r in results.items()}})
    return {"workloads": workloads,
            "moe_layers": {r: v["moe_layers"] for r, v in results.items()}}
