"""The torch backend's CPU kernels as C entry points, for `ubep.native`'s compiled torch path.

`ubep.native.torch_dispatch` / `torch_combine` run a CPU dispatch or combine between its
collectives without Python: they call these by address (numba `cfunc`s) with one int64
block `k` per call shape (`K_*` words: constants the backend fills once, then one call's
inputs, which the C++ side writes, and outputs, which it reads back). They run the kernels
the Python path calls (`torch_layout`), so the layout lives in one place. A kernel's error
(a size out of its plan) sets `k[K_ERR]` instead of raising: the C++ side raises it as a
RuntimeError.
"""

from __future__ import annotations

from numba import carray, cfunc, types

from ubep.native.layout import (  # the blocks' words (C++ reads them too)
    B_BACK,
    B_BACK_AT,
    B_DST,
    B_ERR,
    B_FIN_OFFS_AT,
    B_FIN_ROWS_AT,
    B_HIDDEN,
    B_J0,
    B_J1,
    B_KIND,
    B_NUM_BAGS,
    B_NUM_PAIRS,
    B_NUM_ROWS,
    B_NUM_TOKENS,
    B_OFFS_AT,
    B_OWN,
    B_OWN_AT,
    B_ROWS,
    B_ROWS_AT,
    B_SENDS,
    B_W_AT,
    B_WEIGHTED,
    B_Y,
    K_BLK_BYTES,
    K_ERR,
    K_FIRST,
    K_GATHER_AT,
    K_GATHER_LEN,
    K_GMAX,
    K_HDR_IN,
    K_HROWS,
    K_IDX,
    K_INLINE,
    K_K,
    K_ME,
    K_META_K,
    K_N_ME,
    K_NUM_BACK,
    K_NUM_BAGS,
    K_NUM_RECV,
    K_NUM_REMOTE,
    K_OFFSETS,
    K_OUT,
    K_OUT_BYTES,
    K_PER_RANK,
    K_RECV,
    K_RECV_BYTES,
    K_REMOTE_BAGS,
    K_RES,
    K_RES_LEN,
    K_ROW_BYTES,
    K_SEND,
    K_SEND_BYTES,
    K_SENDS,
    K_SUM_R2,
    K_SUM_S2,
    K_T,
    K_W,
    K_WORK_BYTES,
    K_WORLD,
    K_WS,
    K_WS_LEN,
    K_X,
    K_X_BYTES,
)
from ubep.runtime.shm.atomics import i64_ptr
from ubep.runtime.torch_layout import (
    bag_sums_at,
    final_sums_at,
    gather_at,
    pack_send_at,
    phase2_at,
    read_counts_at,
    read_headers_at,
    recv_plan_at,
)

_SIG = types.void(types.CPointer(types.int64))


@cfunc(_SIG, cache=True, nogil=True)
def pack_c(k):
    """`pack_send_at`: the plan into the workspace, phase 1 (and 2) into the send buffer."""
    try:
        nb, sends, first, n_me = pack_send_at(
            k[K_IDX], k[K_W], k[K_T], k[K_K], k[K_X], k[K_X_BYTES], k[K_SEND], k[K_SEND_BYTES],
            k[K_ROW_BYTES], k[K_PER_RANK], k[K_WORLD], k[K_ME], k[K_META_K], k[K_INLINE],
            k[K_HROWS], k[K_WS], k[K_WS_LEN])
        k[K_NUM_BACK], k[K_SENDS], k[K_FIRST], k[K_N_ME] = nb, sends, first, n_me
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001 - a cfunc cannot raise: the C++ side does
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def headers_c(k):
    """`read_headers_at` of phase 1's received blocks: the largest count, tokens received."""
    try:
        k[K_GMAX], k[K_NUM_BAGS] = read_headers_at(k[K_RECV], k[K_RECV_BYTES], k[K_BLK_BYTES],
                                                   k[K_ME], k[K_WORLD], k[K_WS], k[K_WS_LEN])
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def counts_c(k):
    """`read_counts_at` of the count exchange's headers (no rows in phase 1)."""
    try:
        k[K_GMAX], k[K_NUM_BAGS] = read_counts_at(k[K_HDR_IN], k[K_ME], k[K_WORLD], k[K_WS],
                                                  k[K_WS_LEN])
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def phase2_c(k):
    """`phase2_at`: the rows phase 2 receives from each peer, and the totals both ways."""
    try:
        k[K_SUM_R2], k[K_SUM_S2] = phase2_at(k[K_WS], k[K_WS_LEN], k[K_WORLD], k[K_ME],
                                             k[K_INLINE], 4 * (1 + 2 * k[K_META_K]),
                                             k[K_ROW_BYTES])
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def plan_c(k):
    """`recv_plan_at` of the received bytes (`K_WORK_BYTES` at `K_RECV`): the plan into `res`
    (`K_RES_LEN` words, room for every pair the received tokens could name), recv_x's row
    sources into `K_GATHER_AT` (`K_GATHER_LEN` words); res_offsets' words into
    `K_OFFSETS..`."""
    try:
        _, _, remote_bags, num_recv, off, gather, num_remote = recv_plan_at(
            k[K_RECV], k[K_WORK_BYTES], k[K_ROW_BYTES], k[K_INLINE], k[K_HROWS], k[K_ME],
            k[K_PER_RANK], k[K_WORLD], k[K_T], k[K_K], k[K_META_K], k[K_FIRST], k[K_N_ME],
            k[K_SENDS], k[K_WS], k[K_WS_LEN], k[K_RES], k[K_RES_LEN])
        if off[7] > k[K_RES_LEN] or num_recv > k[K_GATHER_LEN]:
            k[K_ERR] = 2                # more than the room given
            return
        out = carray(i64_ptr(k[K_GATHER_AT]), (num_recv,))
        out[:] = gather[:num_recv]
        k[K_REMOTE_BAGS], k[K_NUM_RECV], k[K_NUM_REMOTE] = remote_bags, num_recv, num_remote
        for i in range(8):
            k[K_OFFSETS + i] = off[i]
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def rows_c(k):
    """`gather_at`: recv_x's `K_NUM_RECV` rows into `K_OUT` (received ones from `K_RECV`,
    this rank's own from x), as `plan_c` found their sources."""
    try:
        n = k[K_NUM_RECV]
        gather_at(k[K_RECV], k[K_WORK_BYTES], k[K_X], k[K_X_BYTES], k[K_OUT], k[K_OUT_BYTES],
                  carray(i64_ptr(k[K_GATHER_AT]), (n,)), k[K_NUM_REMOTE], k[K_ROW_BYTES],
                  k[K_WORLD], k[K_T], k[K_K], k[K_META_K], k[K_FIRST], k[K_N_ME], k[K_WS],
                  k[K_WS_LEN])
        k[K_ERR] = 0
    except Exception:  # noqa: BLE001
        k[K_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def bags_c(b):
    """`bag_sums_at` of bags `B_J0..B_J1` into `B_DST` (combine's expert side), partials
    of the dtype `B_KIND` names."""
    try:
        bag_sums_at(b[B_KIND], b[B_ROWS], b[B_NUM_ROWS], b[B_HIDDEN], b[B_W_AT],
                    b[B_WEIGHTED] != 0, b[B_ROWS_AT], b[B_OFFS_AT], b[B_NUM_PAIRS],
                    b[B_NUM_BAGS], b[B_J0], b[B_J1], b[B_DST])
        b[B_ERR] = 0
    except Exception:  # noqa: BLE001
        b[B_ERR] = 1


@cfunc(_SIG, cache=True, nogil=True)
def final_c(b):
    """`final_sums_at`: each token's received and own partials summed into `B_Y`."""
    try:
        final_sums_at(b[B_KIND], b[B_BACK_AT], b[B_BACK], b[B_OWN_AT], b[B_OWN], b[B_HIDDEN],
                      b[B_FIN_ROWS_AT], b[B_FIN_OFFS_AT], b[B_SENDS], b[B_NUM_TOKENS], b[B_Y])
        b[B_ERR] = 0
    except Exception:  # noqa: BLE001
        b[B_ERR] = 1
