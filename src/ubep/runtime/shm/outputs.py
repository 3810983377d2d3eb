"""Output tensors on kept memory, lent again once the caller has let go of them.

A dispatch returns a fresh `recv_x` the caller keeps, a combine a fresh output. torch on
the CPU allocates such tensors with malloc, which maps a large one freshly (mmap) and
unmaps it on free: every call then takes a page fault for each 4 KiB it writes, and the
kernel zeroes each page first. On this project's host that was 38% of a batch-32
dispatch+combine of the one-worker path (perf: `clear_page_erms`, `exc_page_fault`,
`unmap_page_range`) and made the time per byte jump between batch 16 and 32, where malloc
began to map `recv_x` (3.7 MB) anew on each call.

GPU libraries do not pay this because torch's CUDA caching allocator reuses blocks;
`OutputPool` does the same for the tensors a Buffer returns. It keeps a few blocks of
anonymous memory (2 MiB-aligned, `MADV_HUGEPAGE` where the kernel allows it: fewer TLB
misses), and lends a block for a new output only when nothing uses the previous one: a
block is lent as a fresh numpy view handed to `torch.from_numpy`, whose storage holds that
view until the last tensor, view or numpy array on it is gone; the pool keeps only a weak
reference to the view. Small outputs (under `min_bytes`) stay with torch: malloc reuses
those without faults.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

#: outputs smaller than this come from torch.empty (malloc keeps such chunks on its heap)
MIN_BYTES = 256 << 10
#: blocks a pool keeps: outputs the caller may hold at once before the pool falls back
KEEP = 4
_ALIGN = 2 << 20
_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class OutputPool:
    """Lends `[rows, cols]` tensors on kept memory; falls back to `torch.empty`.

    Arguments:
        keep: blocks kept (each as large as the largest output it served).
        min_bytes: outputs below this size are plain `torch.empty`.
    """

    def __init__(self, keep: int = KEEP, min_bytes: int = MIN_BYTES):
        self._keep = keep
        self._min = min_bytes
        self._blocks: list[np.ndarray] = []          # uint8, page-aligned
        self._lent: list[weakref.ref | None] = []    # per block: the view lent last

    @property
    def min_bytes(self) -> int:
        """Outputs smaller than this are plain `torch.empty`; larger ones are lent."""
        return self._min

    @min_bytes.setter
    def min_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"min_bytes={value} must be >= 0")
        self._min = int(value)

    def empty(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized `[rows, cols]` tensor of `dtype` nobody else uses."""
        es = dtype.itemsize
        nbytes = rows * cols * es
        if nbytes == 0 or nbytes < self._min:
            return torch.empty(rows, cols, dtype=dtype)
        i = self._free_block(nbytes)
        if i < 0:
            return torch.empty(rows, cols, dtype=dtype)
        v = self._blocks[i][:nbytes].view(_INT_OF_SIZE[es]).reshape(rows, cols)
        self._lent[i] = weakref.ref(v)
        t = torch.from_numpy(v)
        return t if t.dtype == dtype else t.view(dtype)

    def _free_block(self, nbytes: int) -> int:
        """The smallest free block of at least `nbytes` (growing or adding one), or -1."""
        best, small = -1, -1
        for i, blk in enumerate(self._blocks):
            ref = self._lent[i]
            if ref is not None and ref() is not None:
                continue                                     # still in use
            if blk.nbytes >= nbytes:
                if best < 0 or blk.nbytes < self._blocks[best].nbytes:
                    best = i
            elif small < 0:
                small = i
        if best >= 0:
            return best
        if small < 0 and len(self._blocks) >= self._keep:
            return -1
        blk = _anonymous(-(-nbytes // _ALIGN) * _ALIGN)
        if small >= 0:                                       # replace a free, too small one
            self._blocks[small], self._lent[small] = blk, None
            return small
        self._blocks.append(blk)
        self._lent.append(None)
        return len(self._blocks) - 1

    def close(self) -> None:
        """Drop the blocks (memory a caller still uses stays until its tensors go)."""
        self._blocks.clear()
        self._lent.clear()


def _anonymous(nbytes: int) -> np.ndarray:
    """`nbytes` of private anonymous memory as uint8 (unmapped when the array goes)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:                    # no transparent huge pages here: 4 KiB pages
            pass
    return np.frombuffer(m, np.uint8)
