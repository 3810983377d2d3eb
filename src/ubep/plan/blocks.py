"""Block formats of the four Data-as-Flag variants (docs/design.md §2.3). Pure: no I/O.

A row travels as a *record* (a small header, then the row's bytes) cut into fixed-size
blocks of `block_bytes`. Every block's last 8-byte word is its *marker*: the word the sender
writes last, with a release store, after the rest of the block.

* **tff** (token-flag fusion): the marker is a flag holding the call's epoch; the payload is
  `block_bytes - 8` bytes per block. A reader that sees the current epoch in every block's
  flag sees the whole record. (The paper uses a 32 B flag in 512 B blocks; 8 B suffice here.)
* **sw** (stop-and-wait): full blocks of payload, then a separate flag per (source worker,
  destination) batch, written after all of that worker's blocks.
* **dc** (data-for-checksum): full blocks; after its batch the sender writes a checksum over
  the marker words of the blocks it sent, plus the epoch. The receiver waits for it and
  verifies the markers before reading.
* **sp** (sentinel polling): full blocks; the receiver arms every marker word with
  `SENTINEL`; a block has arrived when its marker differs. Real rows must not hold the
  sentinel at a marker position (checked before sending); integer and fp8 rows can hold any
  bit pattern, so sp refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

SYNCS = ("sw", "tff", "dc", "sp")
#: bytes of the marker word ending every block
MARKER_BYTES = 8
#: sp's "nothing arrived" pattern: four bf16/two fp32 NaNs (0xFFF7) that arithmetic never
#: produces (x86 and torch produce 0x7FC0/0xFFC0-style canonical NaNs).
SENTINEL = 0xFFF7_FFF7_FFF7_FFF7
SENTINEL_I64 = SENTINEL - (1 << 64)
#: dtypes (by torch name) whose bit patterns never equal SENTINEL in real activations
SENTINEL_SAFE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class BlockFormat:
    """How records are cut into blocks for one sync variant.

    Attributes:
        sync: "sw" | "tff" | "dc" | "sp".
        block_bytes: bytes per block, a multiple of 8, at least 16.
    """

    sync: str
    block_bytes: int

    def __post_init__(self) -> None:
        if self.sync not in SYNCS:
            raise ValueError(f"sync={self.sync!r} is not one of {', '.join(map(repr, SYNCS))}")
        if (isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int)
                or self.block_bytes < 16 or self.block_bytes % MARKER_BYTES):
            raise ValueError(f"block_bytes={self.block_bytes!r} must be a multiple of "
                             f"{MARKER_BYTES} and at least 16")

    @property
    def has_flag(self) -> bool:
        """True for tff: the marker is an epoch flag, not payload."""
        return self.sync == "tff"

    @property
    def per_block_signal(self) -> bool:
        """True when each block announces itself (tff, sp); False for batch signals (sw, dc)."""
        return self.sync in ("tff", "sp")

    @property
    def payload_per_block(self) -> int:
        return self.block_bytes - (MARKER_BYTES if self.has_flag else 0)

    def num_blocks(self, record_bytes: int) -> int:
        """Blocks a record of `record_bytes` occupies (at least one)."""
        return max(1, -(-record_bytes // self.payload_per_block))

    def wire_bytes(self, record_bytes: int) -> int:
        return self.num_blocks(record_bytes) * self.block_bytes

    def efficiency(self, record_bytes: int) -> float:
        """Record bytes over bytes written for it (tff: at most (block - 8) / block)."""
        return record_bytes / self.wire_bytes(record_bytes)

    def marker_positions(self, record_bytes: int) -> list[int]:
        """Record byte offsets of the marker words that carry payload (sw, dc, sp)."""
        if self.has_flag:
            return []
        return [b * self.block_bytes + self.block_bytes - MARKER_BYTES
                for b in range(self.num_blocks(record_bytes))]


def sentinel_refusal(dtype_name: str) -> str | None:
    """Why sp cannot carry rows of `dtype_name` (a torch dtype's name), or None if it can."""
    name = dtype_name.removeprefix("torch.")
    if name in SENTINEL_SAFE_DTYPES:
        return None
    return (f"sync='sp' cannot carry {name} rows: every bit pattern is a valid {name} value, "
            f"so no sentinel is safe; use sync='tff' (token-flag fusion) instead")
