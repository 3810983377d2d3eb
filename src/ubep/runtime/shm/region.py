"""The layout of one rank's shared-memory region: count slots, batch flags, windows.

Every rank owns one region; peers write into it, the owner reads it. Everything exists
twice, indexed by the parity of the call's epoch: a rank can be at most one call ahead of a
peer that still reads (every call waits for a message of the same call from every peer), so
call e+2 never overwrites what call e's reader still needs, and flags holding epoch e-2 are
never taken for call e.

    counts  [2][world] x CW int64  per source: counts of my experts, token workers, dtype,
                                   status, ..., epoch (last word, release-stored)
    dbatch  [2][world][MW] x 8     dispatch batch flags of sw/dc: checksum, ..., epoch
    hello   [2][world] x 8         combine: token workers, dtype, status, ..., epoch
    cbatch  [2][world][MW] x 8     combine batch flags of sw/dc
    dwin    [2][world][DROWS]      dispatch rows from each source (a record per row)
    cwin    [2][CSLOTS]            combine rows back to my tokens, slot t*KMAX + k

Epochs count calls of each kind (+1 per call, `next_epoch`), so the parity flips on every
call: a dispatch's windows are the ones of the dispatch before last. Keeping one half
while dispatch and combine alternate (+2 after a call of the other kind) is as safe, and
was measured side by side (P=2, one worker): its writes into a peer's half are ~2 µs slower
per call at batch 1 (presumably: each send rewrites lines the peer read moments before),
with no consistent gain at batch 8-128 (`docs/sync.md`).

A call packs its records at its own row size (`DSTRIDE`/`CSTRIDE` are the widest, 4-byte
elements, and size each parity's half): bf16 rows take half the bytes and pages rather than
every other half row. Every stride is a multiple of the block size, so records of any size
sit on one block grid: tff flag words and sp markers are always at the same addresses,
whatever the row size of the call before (sp re-arms each block it read).

The layout is packed into one int64 array (`L_*` indices) that every kernel takes.
"""

from __future__ import annotations

import numpy as np

from ubep.plan.blocks import BlockFormat

#: bytes of the header each dispatch record carries before the row: token int32,
#: slot int32, weight float32, pad
META_BYTES = 16
FMT_CODES = {"sw": 0, "tff": 1, "dc": 2, "sp": 3}

(L_WORLD, L_EL, L_MW, L_CW, L_COUNT_OFF, L_DBATCH_OFF, L_HELLO_OFF, L_CBATCH_OFF, L_DWIN_OFF,
 L_DROWS, L_DSTRIDE, L_CWIN_OFF, L_CSLOTS, L_CSTRIDE, L_KMAX, L_BB, L_PPB, L_FMT,
 L_SIZE) = range(19)
L_LEN = 19

#: words of a count/hello slot before the epoch word
SLOT_NTW, SLOT_ELEM, SLOT_STATUS = 0, 1, 2
STATUS_OK, STATUS_ABORT = 0, 1

_PAGE = 4096

# -- the header page (the first page of every region): elastic membership words ------------------
#: `Buffer(elastic=True)`: bit r set = rank r is inactive (dead or removed); every rank that
#: learns of one ors its bit into this word of every region (`membership.py`)
H_INACTIVE = 0
#: the bits of `H_INACTIVE` that `set_active_ranks` removed (the rest died), or-ed first
H_REMOVED = 8
#: `set_active_ranks`'s agreement: per rank s, [mask bits, generation] written by s into every
#: remaining rank's region (the generation word release-stored after the mask)
H_DRAIN_OFF = 64
#: ranks an elastic shm Buffer can have: one bit each in a word
MAX_ELASTIC_RANKS = 64


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def next_epoch(epoch: int) -> int:
    """The epoch of a rank's next dispatch (or combine) after `epoch`, its last one: the
    next parity (see the module doc)."""
    return epoch + 1


def region_layout(*, world: int, experts_per_rank: int, max_workers: int, hidden: int,
                  max_tokens: int, max_top_k: int, fmt: BlockFormat,
                  max_element_bytes: int = 4) -> np.ndarray:
    """The `L_*` layout array of a region for these sizes (identical on every rank)."""
    el = experts_per_rank
    cw = _align(el + 4, 8)
    d_rows = max_tokens * min(max_top_k, el)
    d_stride = fmt.wire_bytes(META_BYTES + hidden * max_element_bytes)
    c_slots = max_tokens * max_top_k
    c_stride = fmt.wire_bytes(hidden * max_element_bytes)
    off = _PAGE  # header page: unused, keeps the rest page-aligned
    count_off = off
    off += 2 * world * cw * 8
    dbatch_off = off
    off += 2 * world * max_workers * 64
    hello_off = off
    off += 2 * world * 64
    cbatch_off = off
    off += 2 * world * max_workers * 64
    dwin_off = off = _align(off, _PAGE)
    off += 2 * world * d_rows * d_stride
    cwin_off = off = _align(off, _PAGE)
    off += 2 * c_slots * c_stride
    size = _align(max(off, _PAGE), _PAGE)
    lay = np.zeros(L_LEN, dtype=np.int64)
    lay[[L_WORLD, L_EL, L_MW, L_CW, L_COUNT_OFF, L_DBATCH_OFF, L_HELLO_OFF, L_CBATCH_OFF,
         L_DWIN_OFF, L_DROWS, L_DSTRIDE, L_CWIN_OFF, L_CSLOTS, L_CSTRIDE, L_KMAX, L_BB, L_PPB,
         L_FMT, L_SIZE]] = [
        world, el, max_workers, cw, count_off, dbatch_off, hello_off, cbatch_off, dwin_off,
        d_rows, d_stride, cwin_off, c_slots, c_stride, max_top_k, fmt.block_bytes,
        fmt.payload_per_block, FMT_CODES[fmt.sync], size]
    return lay


# -- the direct (one-copy) variant's areas, appended to the region when Buffer(direct=True) ---
#
#     counts  [2][DCW] int64   my counts of every global expert, dtype, T, status, the byte
#                              offset of the recv area my rows go to this call, ..., epoch
#     ready   [8] int64        combine: dtype, byte offset of my expert outputs, status, epoch
#     meta    [MAXR] x 16 B    per received row: token int32, slot int32 | weight f32, epoch i32
#                              (the second word is release-stored after the row: the flag)
#     recv    [NRECV][MAXR] rows  received rows, expert-major, packed at hidden x itemsize:
#                              `recv_x` is a view of one. direct=True: one area.
#                              direct="owned": area 0 is scratch (rows copied out of it),
#                              the others are lent as `recv_x` while the caller holds it
#     comb    [MAXR] rows      expert outputs copied here (or written here by the user)
#     done    [world] int64    combine: rank s stores its combine epoch into word s of every
#                              rank once it has read all it needs: an owner's combine returns
#                              only when every peer is done reading its expert outputs
#
# Counts exist twice (epoch parity); the rest once: nobody writes rows, metas or a ready word
# of call e+1 before every rank has published its counts of e+1, which it does only after
# finishing call e's combine (see `direct/path.py`).

(D_COUNTS_OFF, D_CW, D_READY_OFF, D_META_OFF, D_RECV_OFF, D_COMB_OFF, D_MAXR, D_AREA,
 D_END, D_DONE_OFF, D_NRECV) = range(11)
D_LEN = 11
#: words of a direct count slot after the E counts
DC_ELEM, DC_TOKENS, DC_STATUS, DC_RECV = 0, 1, 2, 3
#: direct="owned": recv areas lent as `recv_x` (besides the scratch area): results a caller
#: may hold while the next dispatch lands in place (more held: copied out of the scratch)
OWNED_LENT_AREAS = 2
#: words of the ready slot
DR_ELEM, DR_OFFSET, DR_STATUS, DR_EPOCH = 0, 1, 2, 3


def direct_layout(*, start: int, world: int, num_experts: int, hidden: int, max_tokens: int,
                  max_top_k: int, max_element_bytes: int = 4, recv_areas: int = 1) -> np.ndarray:
    """The `D_*` layout of the direct areas, placed at byte offset `start` of the region."""
    el = num_experts // world
    cw = _align(num_experts + 5, 8)
    max_recv = world * max_tokens * min(max_top_k, el)
    area = _align(max(max_recv, 1) * hidden * max_element_bytes, _PAGE)
    off = _align(start, _PAGE)
    counts_off = off
    off += 2 * cw * 8
    ready_off = off
    off += 64
    meta_off = off = _align(off, 64)
    off += max(max_recv, 1) * 16
    recv_off = off = _align(off, _PAGE)
    off += area * recv_areas
    comb_off = off
    off += area
    done_off = off
    off += _align(world * 8, 64)
    lay = np.zeros(D_LEN, dtype=np.int64)
    lay[:] = [counts_off, cw, ready_off, meta_off, recv_off, comb_off, max_recv, area, off,
              done_off, recv_areas]
    return lay


def segment_layouts(config, *, max_workers: int,
                    fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray | None, int]:
    """A rank's `(L_* layout, D_* layout or None, segment bytes)` for a Buffer `config`.

    With `direct=True` the windows are not used and are kept minimal. The one place the
    segment's size is decided: the shm backend creates it, `backend="auto"` checks it fits.
    """
    c = config
    lay = region_layout(
        world=c.world_size, experts_per_rank=c.experts_per_rank, max_workers=max_workers,
        hidden=1 if c.direct else c.hidden, max_tokens=1 if c.direct else c.max_tokens_per_rank,
        max_top_k=c.max_top_k, fmt=fmt)
    if not c.direct:
        return lay, None, int(lay[L_SIZE])
    dlay = direct_layout(start=int(lay[L_SIZE]), world=c.world_size, num_experts=c.num_experts,
                         hidden=c.hidden, max_tokens=c.max_tokens_per_rank,
                         max_top_k=c.max_top_k,
                         recv_areas=1 + OWNED_LENT_AREAS if c.direct == "owned" else 1)
    return lay, dlay, int(dlay[D_END])
