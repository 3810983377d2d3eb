"""Greedy decoding with a KV cache, timing every step (time per output token, TPOT)."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn

from ubep.moe.convert import ep_layers


@dataclass(frozen=True)
class DecodeResult:
    """One greedy decode of a batch.

    Attributes:
        tokens: `[B, steps + 1]` int64; column 0 comes from the prefill, column i from decode
            step i.
        logits: `[B, steps + 1, vocab]` float32 (the logits each token was picked from), or
            None when not kept.
        step_s: `[steps]` float64; wall time of each decode step (forward + argmax).
        comm_s: `[steps]` float64; of it, time in dispatch+combine (0 for a model without
            EPMoE layers).
        prefill_s: wall time of the prefill forward.
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    step_s: torch.Tensor
    comm_s: torch.Tensor
    prefill_s: float


def _new_cache(model: nn.Module):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt_ids: torch.Tensor, steps: int, *,
                  keep_logits: bool = True) -> DecodeResult:
    """Prefill `prompt_ids` `[B, L]`, then run `steps` greedy decode steps of one token each.

    Always runs exactly `steps` steps (no stopping on EOS): with an EP model every rank must
    make the same number of forwards.
    """
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be a [batch, length] tensor, got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an int >= 0")
    layers = ep_layers(model)
    cache = _new_cache(model)
    key = _cache_kwarg(model)

    def comm_total() -> float:
        return sum(layer.comm_s for layer in layers)

    t0 = time.perf_counter()
    out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1, **{key: cache})
    last = out.logits[:, -1].float()
    nxt = last.argmax(-1)
    prefill_s = time.perf_counter() - t0

    tokens = [nxt]
    logits = [last] if keep_logits else None
    step_s = torch.zeros(steps, dtype=torch.float64)
    comm_s = torch.zeros(steps, dtype=torch.float64)
    for i in range(steps):
        c0 = comm_total()
        t0 = time.perf_counter()
        out = model(input_ids=nxt.unsqueeze(1), use_cache=True, logits_to_keep=1,
                    **{key: cache})
        last = out.logits[:, -1].float()
        nxt = last.argmax(-1)
        step_s[i] = time.perf_counter() - t0
        comm_s[i] = comm_total() - c0
        tokens.append(nxt)
        if keep_logits:
            logits.append(last)
    return DecodeResult(
        tokens=torch.stack(tokens, dim=1),
        logits=torch.stack(logits, dim=1) if keep_logits else None,
        step_s=step_s, comm_s=comm_s, prefill_s=prefill_s)
