"""What one benchmark run measures: `BenchConfig`, checked once, plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ubep.testing import ROUTINGS

#: the systems a run can compare; "bound" (the copy bound) is measured in every run
#: Buffer systems: name -> (backend, mode, direct). "shm-direct" is ubep mode with rows written
#: straight to their final place (`Buffer(direct=True)`). "shm-owned" is
#: the same exchange with results the caller owns (`Buffer(direct="owned")`): rows land in a
#: receive area lent as recv_x while the caller holds it (copied out only when every lent area
#: is held); combine reads a lent recv_x where it lies and copies other expert outputs in once.
BUFFER_SYSTEMS = {"shm-ubep": ("shm", "ubep", False), "shm-direct": ("shm", "ubep", True),
                  "shm-owned": ("shm", "ubep", "owned"), "shm-bsp": ("shm", "bsp", False),
                  "torch": ("torch", "ubep", False)}
#: peers: "mpi" (`ubep.bench.mpi_peer`, under mpiexec) and "agrs" (`ubep.bench.agrs_peer`:
#: all-gather + reduce-scatter, as vLLM's CPU expert parallelism does it)
SYSTEMS = (*BUFFER_SYSTEMS, "mpi", "agrs")
#: what `ubep bench` and `ubep demo` compare unless told: the default path first
#: (shm-owned, what `Buffer(backend="auto")` gives on one host), the other shm variants, gloo
DEFAULT_SYSTEMS = ("shm-owned", "shm-ubep", "shm-direct", "shm-bsp", "torch")
BOUND = "bound"
#: the torch backend's own collectives, replayed bare on the same bytes (runs with "torch")
RAW = "raw"
#: the AgRs peer's all-gather and reduce-scatter, bare on the same bytes (runs with "agrs")
AGRS_RAW = "agrs-raw"
#: the MPI peer's collectives, bare on the same bytes (runs with "mpi")
MPI_RAW = "mpi-raw"
#: each system's bare-collectives line: what its "x raw+copy" is taken against (the torch
#: backend's for the rest)
RAW_OF = {"agrs": AGRS_RAW, AGRS_RAW: AGRS_RAW, "mpi": MPI_RAW, MPI_RAW: MPI_RAW}
DTYPES = ("bfloat16", "float16", "float32")
#: the stand-in expert between dispatch and combine (untimed): "clone" reads every received
#: row and writes a new tensor, combine's input (DeepEP's tests' `simulated_gemm_x =
#: packed_recv_x.clone()`: what a model's expert GEMM does to the caches); "identity" combines
#: recv_x itself, which on one host leaves the rows where the sender's core wrote them
EXPERT_STEPS = ("clone", "identity")


#: named shapes `ubep bench --preset` runs. "deepep-ll": DeepEP's low-latency tables (128
#: tokens a rank, hidden 7168, top-8 of 256 experts, fp8 dispatch with scales, bf16 combine)
PRESETS = {"deepep-ll": {"batches": (128,), "hiddens": (7168,), "top_k": 8, "experts": 256,
                         "dtype": "bfloat16", "fp8": True}}


def _ints(name: str, values) -> tuple[int, ...]:
    out = tuple(values)
    if not out:
        raise ValueError(f"{name} must not be empty")
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must hold positive ints, got {v!r}")
    return out


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: every system, every (ranks, hidden, batch), the same routing."""

    ranks: tuple[int, ...] = field(default=(2,), metadata={"help": "process counts P"})
    hiddens: tuple[int, ...] = field(default=(7168,), metadata={"help": "row widths"})
    batches: tuple[int, ...] = field(default=(1, 8, 16, 64, 128),
                                     metadata={"help": "tokens per rank"})
    top_k: int = field(default=8, metadata={"help": "experts per token"})
    experts: int = field(default=16, metadata={"help": "global expert count E"})
    dtype: str = field(default="bfloat16", metadata={"help": "row dtype"})
    systems: tuple[str, ...] = field(default=DEFAULT_SYSTEMS,
                                     metadata={"help": "systems to compare"})
    iters: int = field(default=100, metadata={"help": "timed iterations per point"})
    warmup: int = field(default=10, metadata={"help": "untimed iterations per point"})
    block: int = field(default=20, metadata={
        "help": "iterations a system runs back to back before the next one takes over (1 = "
                "every iteration interleaves all systems: each call starts on caches the "
                "previous system evicted)"})
    routing: str = field(default="uniform", metadata={"help": "routing kind (ubep.testing)"})
    workers: int | None = field(default=None, metadata={"help": "shm workers per rank"})
    pin: bool = field(default=True, metadata={
        "help": "bind rank r's thread to the r-th usable core when there are at least as many "
                "cores as ranks (as vLLM's CPU workers and numactl/taskset deployments do)"})
    expert: str = field(default="clone", metadata={
        "help": "the stand-in expert between dispatch and combine, untimed: clone (reads "
                "recv_x, writes combine's input, as an expert GEMM does) or identity"})
    fp8: bool = field(default=False, metadata={
        "help": "dispatch float8_e4m3fn rows with one float32 scale per token and 128 "
                "channels (`ubep.quant`), combine rows of `dtype` (DeepEP's low-latency "
                "mode); the stand-in expert dequantizes recv_x into combine's input"})
    seed: int = field(default=0, metadata={"help": "seed of tokens and routing"})
    timeout_s: float = field(default=30.0, metadata={"help": "deadline of every wait"})

    def __post_init__(self):
        object.__setattr__(self, "ranks", _ints("ranks", self.ranks))
        object.__setattr__(self, "hiddens", _ints("hiddens", self.hiddens))
        object.__setattr__(self, "batches", _ints("batches", self.batches))
        object.__setattr__(self, "systems", tuple(self.systems))
        for name in ("top_k", "experts", "iters", "block"):
            _ints(name, [getattr(self, name)])
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be an int >= 0")
        if self.workers is not None:
            _ints("workers", [self.workers])
        for p in self.ranks:
            if self.experts % p:
                raise ValueError(f"experts={self.experts} must be divisible by every rank "
                                 f"count (ranks={p})")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} must be <= experts={self.experts}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.expert not in EXPERT_STEPS:
            raise ValueError(f"expert={self.expert!r} is not one of {EXPERT_STEPS}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is not one of {ROUTINGS}")
        if not self.systems:
            raise ValueError("systems must not be empty")
        for s in self.systems:
            if s not in SYSTEMS:
                raise ValueError(f"system {s!r} is not one of {SYSTEMS}")
        if len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems={self.systems} lists a system twice")
        if self.fp8:
            if any(h % 128 for h in self.hiddens):
                raise ValueError(f"fp8: every hidden must be a multiple of 128 (one scale per "
                                 f"128 channels), got hiddens={self.hiddens}")
            if self.expert != "clone":
                raise ValueError("fp8 needs expert='clone': combine takes the dequantized "
                                 "recv_x")
            peers = [s for s in self.systems if s not in BUFFER_SYSTEMS]
            if peers:
                raise ValueError(f"fp8 runs the Buffer systems only ({', '.join(BUFFER_SYSTEMS)}"
                                 f"); drop {peers}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)
