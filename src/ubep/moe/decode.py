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
        experts_s: `[steps]` float64; of the step, time in the local routed experts (between
            dispatch and combine); None when not recorded.
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    step_s: torch.Tensor
    comm_s: torch.Tensor
    prefill_s: float
    experts_s: torch.Tensor | None = None


def _new_cache(model: nn.Module):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class GreedyDecoder:
    """Greedy decoding of one batch, one step per call, so that several decoders (one per
    backend) can take turns step by step and see the same host load.

    `prefill()` once, then `step()` any number of times, then `result()`. Every rank of an EP
    model must make the same sequence of calls (each MoE layer is a collective).
    """

    def __init__(self, model: nn.Module, prompt_ids: torch.Tensor, *, keep_logits: bool = True):
        if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be a [batch, length] tensor, got "
                             f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
        self.model, self.prompt_ids, self.keep_logits = model, prompt_ids, keep_logits
        self._layers = ep_layers(model)
        self._cache = _new_cache(model)
        self._key = _cache_kwarg(model)
        self._tokens: list[torch.Tensor] = []
        self._logits: list[torch.Tensor] = []
        self._step_s: list[float] = []
        self._comm_s: list[float] = []
        self._experts_s: list[float] = []
        self._prefill_s: float | None = None

    def _forward(self, ids: torch.Tensor) -> None:
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1,
                         **{self._key: self._cache})
        last = out.logits[:, -1].float()
        self._tokens.append(last.argmax(-1))
        if self.keep_logits:
            self._logits.append(last)

    def _totals(self) -> tuple[float, float]:
        return (sum(layer.comm_s for layer in self._layers),
                sum(layer.experts_s for layer in self._layers))

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the prompt through the model; its last logits give the first token."""
        if self._prefill_s is not None:
            raise RuntimeError("prefill() was already called")
        t0 = time.perf_counter()
        self._forward(self.prompt_ids)
        self._prefill_s = time.perf_counter() - t0

    @torch.no_grad()
    def step(self) -> None:
        """Feed the latest token, pick the next one; time the forward and its communication."""
        if self._prefill_s is None:
            raise RuntimeError("call prefill() before step()")
        c0, e0 = self._totals()
        t0 = time.perf_counter()
        self._forward(self._tokens[-1].unsqueeze(1))
        self._step_s.append(time.perf_counter() - t0)
        c1, e1 = self._totals()
        self._comm_s.append(c1 - c0)
        self._experts_s.append(e1 - e0)

    def result(self) -> DecodeResult:
        if self._prefill_s is None:
            raise RuntimeError("nothing decoded yet: call prefill() first")
        return DecodeResult(
            tokens=torch.stack(self._tokens, dim=1),
            logits=torch.stack(self._logits, dim=1) if self.keep_logits else None,
            step_s=torch.tensor(self._step_s, dtype=torch.float64),
            comm_s=torch.tensor(self._comm_s, dtype=torch.float64),
            prefill_s=self._prefill_s,
            experts_s=torch.tensor(self._experts_s, dtype=torch.float64))


def greedy_decode(model: nn.Module, prompt_ids: torch.Tensor, steps: int, *,
                  keep_logits: bool = True) -> DecodeResult:
    """Prefill `prompt_ids` `[B, L]`, then run `steps` greedy decode steps of one token each.

    Always runs exactly `steps` steps (no stopping on EOS): with an EP model every rank must
    make the same number of forwards.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an int >= 0")
    decoder = GreedyDecoder(model, prompt_ids, keep_logits=keep_logits)
    decoder.prefill()
    for _ in range(steps):
        decoder.step()
    return decoder.result()
