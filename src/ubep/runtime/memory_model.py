"""Which memory-ordering guarantee each sync variant relies on, on this machine: `sync_info()`.

The Data-as-Flag variants (docs/design.md §2.3) are correct only if a reader that sees the
flag, marker or checksum word also sees the payload stored before it. Where that comes from
depends on the hardware:

* x86-64: total store order (stores become visible in program order) plus a release store
  of the flag/marker word written after the payload; the release store compiles to a plain
  `mov` and matters as a compiler barrier. A window block is copied by our own loops, not
  `memcpy`/`rep movsb`, whose fast-string stores may become visible out of order among
  themselves (a marker can be the block's own last word). The direct path's rows, each
  guarded by a separate meta word, are copied by `memcpy` and then `sfence`d, which orders
  string and non-temporal stores before the meta word.
* other CPUs (aarch64, ppc64le, riscv64 ...): release/acquire atomics: the payload stores
  happen-before the release store of the flag, which synchronizes with the reader's
  acquire load (`stlr`/`ldar` on Arm).
* the paper's hardware (CloudMatrix384 UB fabric): 512 B stores are observed atomically by
  remote readers, so a flag inside the same 512 B block as its payload needs no ordering.

`ubep.verify` model-checks each variant under the corresponding memory model; `sync_info(
check=True)` runs that check for this machine's model.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

PAPER_ATOMIC_BLOCK_BYTES = 512
PAPER_TFF_FLAG_BYTES = 32

_X86 = ("x86_64", "amd64", "i686", "i386", "x86")


@dataclass(frozen=True)
class VariantGuarantee:
    """How one sync variant learns that data arrived, and what makes that safe here.

    Attributes:
        variant: "sw" | "tff" | "dc" | "sp".
        signal: what the receiver waits for.
        relies_on: the ordering guarantee in force on this machine.
        granularity: "batch" (one signal per (source, destination) batch) or "block".
    """

    variant: str
    signal: str
    relies_on: str
    granularity: str


@dataclass(frozen=True)
class SyncInfo:
    """The synchronization guarantees the runtime relies on, for one CPU architecture.

    Attributes:
        machine: `platform.machine()` (or the value passed to `sync_info`).
        memory_model: "x86-TSO" or "weak (release/acquire)".
        verify_model: the `ubep.verify` model that stands for this machine ("tso" | "weak").
        atomic_store_bytes: the largest store a remote reader sees whole here (8: an aligned
            int64 word) — vs the paper's `paper_atomic_block_bytes` (512).
        flag_store, flag_load: how the flag/marker/checksum word is written and read.
        payload_copy: how payload bytes must be copied so the flag stays last.
        variants: one `VariantGuarantee` per variant.
        paper: what the paper assumes on its hardware.
        verified: None when not checked; else whether `ubep.verify` found every variant
            correct under `verify_model` (2 blocks, 2 epochs, every interleaving).
    """

    machine: str
    memory_model: str
    verify_model: str
    atomic_store_bytes: int
    flag_store: str
    flag_load: str
    payload_copy: str
    variants: tuple[VariantGuarantee, ...]
    paper: str
    paper_atomic_block_bytes: int = PAPER_ATOMIC_BLOCK_BYTES
    verified: bool | None = None

    def variant(self, name: str) -> VariantGuarantee:
        """The guarantee of variant `name`; ValueError if there is no such variant."""
        for v in self.variants:
            if v.variant == name:
                return v
        raise ValueError(f"variant={name!r} is not one of "
                         f"{', '.join(repr(v.variant) for v in self.variants)}")

    def __str__(self) -> str:
        lines = [
            f"machine {self.machine}: {self.memory_model} "
            f"(atomic stores up to {self.atomic_store_bytes} B)",
            f"  flag/marker store: {self.flag_store}",
            f"  flag/marker load:  {self.flag_load}",
            f"  payload copy:      {self.payload_copy}",
        ]
        for v in self.variants:
            lines.append(f"  {v.variant:<3} [{v.granularity}] waits for {v.signal}; "
                         f"relies on {v.relies_on}")
        lines.append(f"  paper's hardware: {self.paper}")
        if self.verified is not None:
            state = "all variants correct" if self.verified else "A VARIANT FAILED"
            lines.append(f"  protocol check (ubep.verify, model {self.verify_model!r}): {state}")
        return "\n".join(lines)


def _variants(order: str) -> tuple[VariantGuarantee, ...]:
    return (
        VariantGuarantee("sw", "a separate flag per (source worker, destination) batch, a "
                         "release store after all of that worker's blocks",
                         f"the flag written after the batch; {order}", "batch"),
        VariantGuarantee("tff", "the flag word of each block to hold the call's epoch",
                         f"the flag word written after the block's payload; {order}", "block"),
        VariantGuarantee("dc", "a checksum word (epoch + checksum of the blocks' marker words) "
                         "after the batch, then markers matching it",
                         f"the checksum word written after every block; {order}; the marker "
                         "check catches corruption, not reordering", "batch"),
        VariantGuarantee("sp", "each block's marker word to differ from the sentinel the "
                         "receiver armed it with (re-armed after consuming)",
                         f"the marker word written after the block's payload; {order}; the "
                         "re-arm stores ordered before the release that frees the window",
                         "block"),
    )


def sync_info(machine: str | None = None, *, check: bool = False) -> SyncInfo:
    """Report which ordering guarantee each sync variant relies on for `machine`.

    Arguments:
        machine: a `platform.machine()` string; None = this machine.
        check: also run the protocol check (`ubep.verify`) of the four variants under the
            memory model that stands for `machine` (a fraction of a second).

    Returns:
        A frozen `SyncInfo`; `str()` of it is a readable summary.
    """
    if machine is None:
        machine = platform.machine()
    if not isinstance(machine, str) or not machine:
        raise ValueError(f"machine={machine!r} must be a non-empty platform.machine() string")
    x86 = machine.lower() in _X86
    if x86:
        order = "x86-TSO keeps stores in program order (the release store is a plain mov + " \
                "compiler barrier)"
        info = dict(
            memory_model="x86-TSO", verify_model="tso", atomic_store_bytes=8,
            flag_store="LLVM `store atomic i64 release` (a plain mov on x86) after the payload",
            flag_load="LLVM `load atomic i64 acquire` in a spin loop with pause and a deadline",
            payload_copy="window blocks: our own word loops before the flag store, never "
                         "memcpy/rep movsb, whose fast-string stores may become visible out "
                         "of order; the direct path's rows: memcpy, then sfence, then their "
                         "separate meta word")
    else:
        order = "release/acquire atomics order the payload before the flag"
        info = dict(
            memory_model="weak (release/acquire)", verify_model="weak", atomic_store_bytes=8,
            flag_store="LLVM `store atomic i64 release` (e.g. stlr on aarch64) after the payload",
            flag_load="LLVM `load atomic i64 acquire` (e.g. ldar on aarch64) in a spin loop "
                      "with a deadline",
            payload_copy="any plain stores, as long as they precede the release store in "
                         "program order")
    verified = None
    if check:
        from ubep.verify import check as run_check
        from ubep.verify.protocols import dc, sp, sw, tff

        model = info["verify_model"]
        verified = all(run_check(make(repeat=rep), model).ok
                       for make in (sw, tff, dc, sp) for rep in (False, True))
    paper = (f"{PAPER_ATOMIC_BLOCK_BYTES} B stores are observed atomically by remote readers "
             f"(UB fabric), so a TFF block ({PAPER_TFF_FLAG_BYTES} B flag + "
             f"{PAPER_ATOMIC_BLOCK_BYTES - PAPER_TFF_FLAG_BYTES} B payload) needs no ordering "
             f"inside it; blocks are not ordered with each other, so sw needs its fence and dc its "
             f"epoch word ordered after the blocks")
    return SyncInfo(machine=machine, variants=_variants(order), paper=paper,
                    verified=verified, **info)
