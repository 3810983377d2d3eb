"""The validated options of a Buffer: backend, mode, sync variant, schedule.

One frozen dataclass (`BufferConfig`) carries them from `Buffer` to whichever executor
runs the call, so every executor sees the same, already-checked values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("auto", "torch", "shm", "hybrid")
MODES = ("ubep", "bsp")
SYNCS = ("sw", "tff", "dc", "sp")
SCHEDULES = ("static", "balanced", "hierarchical")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return `value` if it is one of `allowed`, else raise ValueError naming `name`."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Return `value` as int if it is an integer >= `minimum`, else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class BufferConfig:
    """Everything an executor needs to know about a Buffer, checked once."""

    rank: int = field(metadata={"help": "this process's rank in the group"})
    world_size: int = field(metadata={"help": "number of ranks in the group"})
    num_experts: int = field(metadata={"help": "global expert count E, divisible by world_size"})
    hidden: int = field(metadata={"help": "elements per token row"})
    max_tokens_per_rank: int = field(metadata={"help": "largest T any call may pass"})
    max_top_k: int = field(metadata={"help": "largest K any call may pass"})
    backend: str = field(default="torch", metadata={
        "help": "executor that runs the calls: torch | shm | hybrid (what backend='auto' chose)"})
    mode: str = field(default="ubep", metadata={"help": "ubep (decomposed) | bsp (baseline)"})
    sync: str = field(default="tff", metadata={"help": "sw | tff | dc | sp"})
    schedule: str = field(default="hierarchical", metadata={"help": "static|balanced|hierarchical"})
    workers: int | None = field(default=None, metadata={"help": "worker threads per rank"})
    count_workers: int | None = field(default=None, metadata={"help": "workers in count role"})
    block_bytes: int = field(default=512, metadata={"help": "sync block size in bytes"})
    timeout_s: float = field(default=30.0, metadata={"help": "deadline of every wait, seconds"})
    topology: Any = field(default=None, metadata={"help": "ubep.Topology, preset name or None"})
    direct: bool = field(default=False, metadata={
        "help": "shm: rows written straight to their final place (recv_x is a buffer view)"})
    elastic: bool = field(default=False, metadata={
        "help": "a rank found dead (or removed) leaves active_ranks; calls go on without it"})
    requested_backend: str = field(default="", metadata={
        "help": "the backend= the Buffer was given: auto | torch | shm"})
    backend_reason: str = field(default="", metadata={
        "help": "why `backend` runs the calls (backend='auto': what was found)"})
    hosts: tuple[tuple[int, ...], ...] = field(default=(), metadata={
        "help": "the group ranks of each shared-memory domain (host), when auto or the "
                "hybrid backend looked; () otherwise"})

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size
