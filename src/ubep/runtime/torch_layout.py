"""The torch backend's index bookkeeping as two compiled passes (numba), one per side.

At batch 1 the rows are a few KB and the collectives ~100 µs each; what the backend adds is
host work, and ~80 numpy/torch calls at a few µs each cost more than the data. These two
kernels compute every index array a dispatch and its combine need in one call per side.

Row layout they describe (the torch backend moves the bytes):

* send side: tokens by destination rank, then token index; a token goes to a rank once if
  any of its experts lives there, with its routing words `[token, top-k expert ids, top-k
  weight bits]` (int32);
* receive side: "bags" = the received tokens, remote sources in rank order then this rank's
  own; pairs (bag, slot) whose expert is local, laid out expert-major, then source rank,
  then token (the oracle's order); combine sums each bag's pairs in slot order.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, types
from numba.extending import overload

from ubep.runtime.shm.atomics import bits_to_f32, memcpy_at, void_ptr
from ubep.runtime.shm.kernels.combine import f16_to_f32, f32_bits_to_f16


@njit(nogil=True, cache=True)
def copy_row(dst, d, src, s, n):
    """Words `src[s:s + n]` into `dst[d:d + n]` (flat arrays of one word type) by memcpy:
    nothing orders the torch backend's rows but the collectives around them, and memcpy's
    string stores write a cold line without reading it first (docs/results/torch_backend.md)."""
    if d < 0 or s < 0 or d + n > dst.shape[0] or s + n > src.shape[0]:
        raise IndexError("torch backend: a row copy out of its arrays' bounds")
    size = dst.itemsize
    memcpy_at(dst.ctypes.data + d * size, src.ctypes.data + s * size, n * size)


@njit(nogil=True, cache=True)
def send_plan(idx, weights, per_rank, world, me, meta_k):
    """Where each of this rank's tokens goes, and where its partial sums come back.

    Args: `idx` `[T, K]` int64 (-1 = unrouted), `weights` `[T, K]` float32; `meta_k` >= K,
    the slots every rank's routing words hold (the Buffer's max_top_k: ranks may call
    with different K, their words must still line up).
    Returns `(per_dest [P], token_of [S], meta [S, 1 + 2 meta_k] int32, final_rows [H],
    final_offsets [T], num_back)`: `token_of`/`meta` list the (destination, token) sends,
    destination-major then token; `final_rows[final_offsets[t]:...]` are token t's partial
    rows in the combine work buffer `[partials returned by remote ranks, in rank order |
    own partials]`, in rank order; `num_back` = rows returned by remote ranks.
    """
    num_tokens, top_k = idx.shape
    most = num_tokens * min(top_k, world)
    per_dest = np.zeros(world, dtype=np.int64)
    token_of = np.empty(most, dtype=np.int64)
    meta = np.empty((most, 1 + 2 * meta_k), dtype=np.int32)
    final_rows = np.empty(most, dtype=np.int64)
    final_offsets = np.empty(num_tokens, dtype=np.int64)
    num_back, total = _send_plan_into(idx, weights, per_rank, world, me, meta_k, per_dest,
                                      token_of, meta, final_rows, final_offsets)
    return (per_dest, token_of[:total], meta[:total], final_rows[:total], final_offsets,
            num_back)


@njit(nogil=True, cache=True)
def _send_plan_into(idx, weights, per_rank, world, me, meta_k, per_dest, token_of, meta,
                    final_rows, final_offsets):
    """`send_plan` into the caller's arrays (`token_of`, `meta`, `final_rows` with room for
    `T * min(K, P)` sends); returns `(num_back, sends)`."""
    num_tokens, top_k = idx.shape
    if (per_dest.shape[0] < world or final_offsets.shape[0] < num_tokens
            or meta.shape[1] != 1 + 2 * meta_k):
        raise IndexError("torch backend: send plan arrays too small")
    dests = np.empty((num_tokens, top_k), dtype=np.int64)   # token's ranks, ascending
    ndest = np.zeros(num_tokens, dtype=np.int64)
    per_dest[:world] = 0
    for t in range(num_tokens):
        n = 0
        for k in range(top_k):
            e = idx[t, k]
            if e < 0:
                continue
            d = e // per_rank
            j = n                                   # insertion, skipping a repeat
            while j > 0 and dests[t, j - 1] > d:
                j -= 1
            if j > 0 and dests[t, j - 1] == d:
                continue
            for i in range(n, j, -1):
                dests[t, i] = dests[t, i - 1]
            dests[t, j] = d
            n += 1
        ndest[t] = n
        for i in range(n):
            per_dest[dests[t, i]] += 1
    start = np.zeros(world + 1, dtype=np.int64)
    for d in range(world):
        start[d + 1] = start[d] + per_dest[d]
    total = start[world]
    if total > token_of.shape[0] or total > meta.shape[0] or total > final_rows.shape[0]:
        raise IndexError("torch backend: send plan arrays too small")
    num_back = total - per_dest[me]
    base = np.zeros(world, dtype=np.int64)                   # combine work row of rank d
    acc = 0
    for d in range(world):
        if d != me:
            base[d] = acc
            acc += per_dest[d]
    base[me] = num_back
    wbits = weights.view(np.int32)
    cursor = start[:world].copy()
    h = 0
    for t in range(num_tokens):
        final_offsets[t] = h
        for i in range(ndest[t]):
            d = dests[t, i]
            p = cursor[d]
            cursor[d] += 1
            token_of[p] = t
            meta[p, 0] = t
            for k in range(meta_k):
                meta[p, 1 + k] = idx[t, k] if k < top_k else -1
                meta[p, 1 + meta_k + k] = wbits[t, k] if k < top_k else 0
            final_rows[h] = base[d] + p - start[d]
            h += 1
    return num_back, total


@njit(nogil=True, cache=True)
def _bf16_bits(bits):
    """float32 bits (the low 32 of integer `bits`) -> bfloat16 bits, to nearest even as
    `.to(torch.bfloat16)`; NaN stays a quiet NaN of its sign."""
    b = np.int64(bits) & 0xFFFFFFFF
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(((b >> 16) & 0x8000) | 0x7FC0)
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@njit(nogil=True, cache=True)
def _word(buf, off):
    """The little-endian int32 at byte `off` of uint8 `buf` (any alignment)."""
    v = (np.int64(buf[off]) | (np.int64(buf[off + 1]) << 8) | (np.int64(buf[off + 2]) << 16)
         | (np.int64(buf[off + 3]) << 24))
    return np.int32(v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v)


@njit(nogil=True, cache=True)
def recv_plan(work, segs, own_meta, own_row, me, per_rank, world, bf16_weights):
    """The expert-major layout of the received pairs and how combine sums them back.

    Args: `work` the dispatch work buffer's bytes (flat uint8; only routing words are
    read); `segs` `[S, 4]` the runs of received tokens in bag order (remote sources in rank
    order, each source's tokens in index order): `(source, count, byte offset of their
    routing words, row of the first)`; `own_meta` `[n_me, 1 + 2K]` int32, the routing words
    of this rank's own tokens, whose rows start at row `own_row`.
    Returns `(gather [N], origins [3, N], recv_weights [N] float32, tokens_per_expert [R],
    bag_rows [N], bag_offsets [J], bag_rows2 [2N], bag_offsets2 [J], weights2 [2N] uint16,
    num_remote_bags)`: `gather` picks recv_x's rows from the work buffer;
    `bag_rows[bag_offsets[j]:...]` are bag j's rows of expert_out in slot order; with
    `bf16_weights`, `weights2` holds each pair's weight as bfloat16 `hi, lo` and
    `bag_rows2`/`bag_offsets2` list each row twice (empty otherwise).
    """
    meta, bag_src, bag_row, num_remote_bags = _recv_bags(work, segs, own_meta, own_row, me)
    num_bags = meta.shape[0]
    counts = np.empty(per_rank * world, dtype=np.int64)
    num_recv = _recv_count(meta, bag_src, me, per_rank, world, counts)
    gather = np.empty(num_recv, dtype=np.int64)
    origins = np.empty((3, num_recv), dtype=np.int64)
    recv_weights = np.empty(num_recv, dtype=np.float32)
    tokens_per_expert = np.empty(per_rank, dtype=np.int64)
    bag_rows = np.empty(num_recv, dtype=np.int64)
    bag_offsets = np.empty(num_bags, dtype=np.int64)
    _recv_fill(meta, bag_src, bag_row, counts, me, per_rank, world, gather, origins,
               recv_weights.view(np.int32), tokens_per_expert, bag_rows, bag_offsets)
    n2 = 2 * num_recv if bf16_weights else 0
    bag_rows2 = np.empty(n2, dtype=np.int64)
    bag_offsets2 = np.empty(num_bags if bf16_weights else 0, dtype=np.int64)
    weights2 = np.empty(n2, dtype=np.uint16)
    if bf16_weights:
        rw_bits = recv_weights.view(np.int32)
        scratch = np.empty(1, dtype=np.float32)             # float <-> bits
        scratch_bits = scratch.view(np.uint32)
        for j in range(num_bags):
            bag_offsets2[j] = 2 * bag_offsets[j]
        for q in range(num_recv):
            p = bag_rows[q]
            hi = _bf16_bits(rw_bits[p])
            scratch_bits[0] = np.uint32(hi) << 16
            scratch[0] = recv_weights[p] - scratch[0]
            bag_rows2[2 * q] = p
            bag_rows2[2 * q + 1] = p
            weights2[2 * q] = hi
            weights2[2 * q + 1] = _bf16_bits(scratch_bits[0])
    return (gather, origins, recv_weights, tokens_per_expert, bag_rows, bag_offsets, bag_rows2,
            bag_offsets2, weights2, num_remote_bags)


@njit(nogil=True, cache=True)
def _recv_bags(work, segs, own_meta, own_row, me):
    """The bags' routing words, sources and rows (`recv_plan`'s args): remote sources in
    rank order, then this rank's own tokens. Returns `(meta, bag_src, bag_row,
    num_remote_bags)`."""
    meta_words = own_meta.shape[1]
    n_me = own_meta.shape[0]
    num_bags = n_me
    for i in range(segs.shape[0]):
        num_bags += segs[i, 1]
    meta = np.empty((num_bags, meta_words), dtype=np.int32)
    bag_src = np.empty(num_bags, dtype=np.int64)
    bag_row = np.empty(num_bags, dtype=np.int64)
    j = 0
    for i in range(segs.shape[0]):
        s, n, off, row = segs[i, 0], segs[i, 1], segs[i, 2], segs[i, 3]
        if n and (off < 0 or off + 4 * meta_words * n > work.shape[0]):
            raise IndexError("torch backend: routing words out of the received bytes")
        for t in range(n):
            for w in range(meta_words):
                meta[j, w] = _word(work, off + 4 * w)
            off += 4 * meta_words
            bag_src[j] = s
            bag_row[j] = row + t
            j += 1
    num_remote_bags = j
    for i in range(n_me):
        meta[j] = own_meta[i]
        bag_src[j] = me
        bag_row[j] = own_row + i
        j += 1
    return meta, bag_src, bag_row, num_remote_bags


@njit(nogil=True, cache=True)
def _recv_count(meta, bag_src, me, per_rank, world, counts):
    """Pairs per (local expert, source) into `counts`; returns their total."""
    top_k = (meta.shape[1] - 1) // 2
    lo_e = me * per_rank
    counts[:] = 0
    for j in range(meta.shape[0]):
        s = bag_src[j]
        for k in range(top_k):
            e = meta[j, 1 + k] - lo_e
            if 0 <= e < per_rank:
                counts[e * world + s] += 1
    return counts.sum()


@njit(nogil=True, cache=True)
def _recv_fill(meta, bag_src, bag_row, counts, me, per_rank, world, gather, origins, rw_bits,
               tokens_per_expert, bag_rows, bag_offsets):
    """`recv_plan`'s arrays written into the caller's (sized by `_recv_count`); `rw_bits`
    the received weights' float32 bits (int32)."""
    top_k = (meta.shape[1] - 1) // 2
    lo_e = me * per_rank
    num_recv = 0
    pos = np.empty(per_rank * world, dtype=np.int64)
    tokens_per_expert[:] = 0
    for b in range(per_rank * world):
        pos[b] = num_recv
        num_recv += counts[b]
        tokens_per_expert[b // world] += counts[b]
    q = 0
    # bags of one source come in token order and sources in rank order within each
    # (expert, source) block, so filling blocks in bag order keeps the oracle's token order
    for j in range(meta.shape[0]):
        s = bag_src[j]
        bag_offsets[j] = q
        for k in range(top_k):
            e = meta[j, 1 + k] - lo_e
            if not 0 <= e < per_rank:
                continue
            b = e * world + s
            p = pos[b]
            pos[b] += 1
            gather[p] = bag_row[j]
            origins[0, p] = s
            origins[1, p] = meta[j, 0]
            origins[2, p] = k
            rw_bits[p] = meta[j, 1 + top_k + k]
            bag_rows[q] = p
            q += 1


# -- the CPU path: the bytes moved by the same compiled calls ---------------------------------
# On CPU the rows are host memory, so the passes that lay out the send buffer and the one
# that gathers recv_x are compiled too: a batch-1 dispatch is three calls (`pack_send_at`
# before its collective, `read_headers_at` and `recv_gather_at` after), instead of ~40
# numpy/torch calls with their Python glue. The layout written is the one the device path
# writes with torch ops (see TorchBackend).
#
# What a call costs besides its work is its arrays: numba boxes every array it returns
# (~0.5 µs each warm, tens of µs after a layer's worth of other memory traffic) and unboxes
# every array it is given, while ints are nearly free. So these kernels take addresses and
# sizes: x, the routing and the send/receive scratch by address, the per-call scratch
# (counts, send plan, routing words) in one kept int64 workspace (`ws_size` words, layout
# `_ws`); what a dispatch hands to its caller and its combine comes back as ONE int64 array
# (`res`, layout `res_offsets`). Sizes are checked against the arrays they describe: a
# wrong one raises IndexError instead of reading or writing past them.

#: int64 words of the workspace before its per-shape part: per_dest, send2, srcs, recv2
#: [P] each, the header block to each peer [P, 4] int32
_WS_HEAD = 6


@njit(nogil=True, cache=True)
def _ws_layout(world, num_tokens, top_k, meta_k):
    """The workspace's layout, the one place it is computed: `(o, most, mw, size)` = where its
    per-shape part starts (int64 words), the most sends `T * min(K, P)`, the routing words
    per send, and its size in int64 words."""
    most, mw = num_tokens * min(top_k, world), 1 + 2 * meta_k
    o = _WS_HEAD * world
    return o, most, mw, o + 2 * most + num_tokens + (most * mw + 1) // 2


def ws_size(world: int, num_tokens: int, top_k: int, meta_k: int) -> int:
    """int64 words of the workspace a CPU dispatch of `num_tokens` x `top_k` needs."""
    return _ws_layout(world, num_tokens, top_k, meta_k)[3]


def ws_views(ws: np.ndarray, world: int, num_tokens: int, top_k: int, meta_k: int) -> tuple:
    """The workspace's parts as numpy views (`_ws`'s layout): `(per_dest, send2, srcs,
    recv2, header [P, 4] int32, token_of, final_rows, final_offsets, meta [S, 1 + 2 meta_k]
    int32)`, S = `num_tokens * min(top_k, world)` (the most sends)."""
    o, most, mw, _ = _ws_layout(world, num_tokens, top_k, meta_k)
    return (ws[:world], ws[world:2 * world], ws[2 * world:3 * world],
            ws[3 * world:4 * world], ws[4 * world:o].view(np.int32).reshape(world, 4),
            ws[o:o + most], ws[o + most:o + 2 * most],
            ws[o + 2 * most:o + 2 * most + num_tokens],
            ws[o + 2 * most + num_tokens:].view(np.int32)[:most * mw].reshape(most, mw))


@njit(nogil=True, cache=True)
def _i64_at(addr, at, n):
    """`n` int64 at word `at` of address `addr`."""
    return carray(void_ptr(addr + 8 * at), (n,), np.int64)


@njit(nogil=True, cache=True)
def _ws_head(addr, size, world):
    """The workspace's head (`_WS_HEAD * world` words, checked against `size`):
    `(per_dest, send2, srcs, recv2, header [P, 4] int32)`."""
    if world < 1 or size < _WS_HEAD * world:
        raise IndexError("torch backend: workspace smaller than its layout")
    return (_i64_at(addr, 0, world), _i64_at(addr, world, world),
            _i64_at(addr, 2 * world, world), _i64_at(addr, 3 * world, world),
            carray(void_ptr(addr + 8 * 4 * world), (world, 4), np.int32))


@njit(nogil=True, cache=True)
def _ws(addr, size, world, num_tokens, top_k, meta_k):
    """`ws_views` inside a kernel, over `size` int64 words at `addr` (checked)."""
    o, most, mw, need = _ws_layout(world, num_tokens, top_k, meta_k)
    if size < need:
        raise IndexError("torch backend: workspace smaller than its layout")
    per_dest, send2, srcs, recv2, header = _ws_head(addr, size, world)
    return (per_dest, send2, srcs, recv2, header,
            _i64_at(addr, o, most), _i64_at(addr, o + most, most),
            _i64_at(addr, o + 2 * most, num_tokens),
            carray(void_ptr(addr + 8 * (o + 2 * most + num_tokens)), (most, mw), np.int32))


@njit(nogil=True, cache=True)
def res_offsets(num_recv, num_bags, per_rank, sends, num_tokens):
    """Where `recv_gather_at`'s result array holds each part (int64 words): `(origins [3, N],
    bag_rows [N], bag_offsets [J], tokens_per_expert [R], final_rows [S], final_offsets [T],
    recv_weights [N] float32, end)`; N = `num_recv`, J = `num_bags`, R = `per_rank`,
    S = `sends`, T = `num_tokens`."""
    o_br = 3 * num_recv
    o_bo = o_br + num_recv
    o_tpe = o_bo + num_bags
    o_fr = o_tpe + per_rank
    o_fo = o_fr + sends
    o_w = o_fo + num_tokens
    return 0, o_br, o_bo, o_tpe, o_fr, o_fo, o_w, o_w + (num_recv + 1) // 2


@njit(nogil=True, cache=True)
def _put_bytes(dst, off, src):
    """Bytes of uint8 `src` into flat uint8 `dst` at byte `off`."""
    if off < 0 or off + src.shape[0] > dst.shape[0]:
        raise IndexError("torch backend: a byte copy out of its array's bounds")
    for i in range(src.shape[0]):
        dst[off + i] = src[i]


@njit(nogil=True, cache=True)
def _put_rows(send, row, x, token_of, first, n, rw):
    """Rows `x[token_of[first:first + n]]` into rows `row..row + n` of `send`: flat arrays of
    one word type, `rw` words a row."""
    for i in range(n):
        copy_row(send, (row + i) * rw, x, token_of[first + i] * rw, rw)


@njit(nogil=True, cache=True)
def pack_send_at(idx_addr, w_addr, num_tokens, top_k, x_addr, x_bytes, send_addr, send_bytes,
                 row_bytes, per_rank, world, me, meta_k, inline, hrows, ws_addr, ws_len):
    """`send_plan` into the workspace, then the send buffer written: phase 1 and phase 2
    of every peer.

    By address: topk_idx (int64) and topk_weights (float32) `[T, K]`, x (`x_bytes`), the
    send buffer (`send_bytes`, room for `(world - 1) * (hrows + inline)` phase-1 rows and
    every peer's phase-2 rows) and the workspace (`ws_len` int64 words, `_ws`). Phase 1
    (only when `inline` > 0): to each peer, in rank order, `hrows + inline` rows = [16-byte
    header: its token count, this rank's largest count to any peer][routing words of its
    first `inline` tokens][their rows]. Phase 2, from row `(world - 1) * (hrows + inline)`:
    to each peer with more than `inline` tokens, [routing words of the rest][their rows].
    Writes the workspace's per_dest, send2 (rows of phase 2 per peer), header (what the
    header block to each peer holds), token_of, meta, final_rows, final_offsets; returns
    `(num_back, sends, first, n_me)`: partial rows that come back, (destination, token)
    sends, where this rank's own tokens start among them and how many.
    """
    idx = carray(void_ptr(idx_addr), (num_tokens, top_k), np.int64)
    weights = carray(void_ptr(w_addr), (num_tokens, top_k), np.float32)
    x = carray(void_ptr(x_addr), (x_bytes,), np.uint8)
    flat = carray(void_ptr(send_addr), (send_bytes,), np.uint8)
    (per_dest, send2, _, _, header, token_of, final_rows, final_offsets,
     meta) = _ws(ws_addr, ws_len, world, num_tokens, top_k, meta_k)
    num_back, sends = _send_plan_into(idx, weights, per_rank, world, me, meta_k, per_dest,
                                      token_of, meta, final_rows, final_offsets)
    meta_bytes = 4 * meta.shape[1]
    my_max = 0
    for d in range(world):
        if d != me and per_dest[d] > my_max:
            my_max = per_dest[d]
    for d in range(world):
        header[d, 0] = per_dest[d]
        header[d, 1] = my_max
        header[d, 2] = 0
        header[d, 3] = 0
    meta_u8 = carray(void_ptr(meta.ctypes.data), (sends * meta_bytes,), np.uint8)
    head_u8 = carray(void_ptr(header.ctypes.data), (16 * world,), np.uint8)
    blk = hrows + inline
    row2 = (world - 1) * blk
    first, slot, mine = 0, 0, 0
    for d in range(world):
        n = per_dest[d]
        send2[d] = 0
        if d == me:
            mine = first
            first += n
            continue
        n1 = min(n, inline)
        if inline:
            b0 = slot * blk
            _put_bytes(flat, b0 * row_bytes, head_u8[16 * d:16 * d + 16])
            _put_bytes(flat, b0 * row_bytes + 16,
                       meta_u8[first * meta_bytes:(first + n1) * meta_bytes])
            _put_rows(flat, b0 + hrows, x, token_of, first, n1, row_bytes)
            slot += 1
        if n > n1:
            m = n - n1
            mrows = -(-(m * meta_bytes) // row_bytes)
            _put_bytes(flat, row2 * row_bytes,
                       meta_u8[(first + n1) * meta_bytes:(first + n) * meta_bytes])
            _put_rows(flat, row2 + mrows, x, token_of, first + n1, m, row_bytes)
            send2[d] = mrows + m
            row2 += send2[d]
        first += n
    return num_back, sends, mine, per_dest[me]


@njit(nogil=True, cache=True)
def read_headers_at(work_addr, work_bytes, blk_bytes, me, world, ws_addr, ws_len):
    """Phase 1's headers into the workspace's `srcs` (tokens each peer sends here; this
    rank's own count from its header row) and `recv2` (zeros); returns `(the largest count
    any rank sends any peer, sum(srcs))`. `work` (`work_bytes` at `work_addr`): peer blocks
    of `blk_bytes` in rank order (this rank skipped)."""
    work = carray(void_ptr(work_addr), (work_bytes,), np.uint8)
    if world < 1 or ws_len < _WS_HEAD * world or (world - 1) * blk_bytes > work_bytes \
            or (world > 1 and blk_bytes < 8):
        raise IndexError("torch backend: headers out of their arrays' bounds")
    _, _, srcs, recv2, header = _ws_head(ws_addr, ws_len, world)
    global_max = np.int64(header[me, 1])
    slot, total = 0, 0
    for r in range(world):
        recv2[r] = 0
        if r == me:
            srcs[r] = header[me, 0]
        else:
            off = slot * blk_bytes
            srcs[r] = _word(work, off)
            m = np.int64(_word(work, off + 4))
            if m > global_max:
                global_max = m
            slot += 1
        total += srcs[r]
    return global_max, total


@njit(nogil=True, cache=True)
def read_counts_at(hdr_addr, me, world, ws_addr, ws_len):
    """The count exchange's headers (`[world, 4]` int32 at `hdr_addr`: row r = rank r's
    header to this rank) into the workspace's `srcs` (this rank's own count from its header
    row) and `recv2` (zeros), as `read_headers_at` does for phase 1; returns `(the largest
    count any rank sends any peer, sum(srcs))`."""
    _, _, srcs, recv2, header = _ws_head(ws_addr, ws_len, world)
    hdr = carray(void_ptr(hdr_addr), (world, 4), np.int32)
    global_max, total = np.int64(0), 0
    for r in range(world):
        recv2[r] = 0
        srcs[r] = header[me, 0] if r == me else hdr[r, 0]
        m = np.int64(header[me, 1] if r == me else hdr[r, 1])
        if m > global_max:
            global_max = m
        total += srcs[r]
    return global_max, total


@njit(nogil=True, cache=True)
def phase2_at(ws_addr, ws_len, world, me, inline, meta_bytes, row_bytes):
    """Phase 2's rows from each peer into the workspace's `recv2` (a peer that sends more
    than `inline` tokens: the rest's routing words, rounded up to whole rows, then their
    rows); returns `(rows received, rows sent)` in phase 2 (`send2`, from `pack_send_at`)."""
    _, send2, srcs, recv2, _ = _ws_head(ws_addr, ws_len, world)
    got, sent = 0, 0
    for s in range(world):
        n = srcs[s]
        if s == me or n <= inline:
            recv2[s] = 0
        else:
            recv2[s] = -(-(n - inline) * meta_bytes // row_bytes) + n - inline
        got += recv2[s]
        sent += send2[s]
    return got, sent


@njit(nogil=True, cache=True)
def _recv_segs(srcs, recv2, inline, hrows, row_bytes, me, world):
    """The runs of received tokens in the layout `pack_send_at` writes, found from the
    peers' counts (`srcs`) and phase-2 rows (`recv2`): `(segs [S, 4] as `recv_plan` takes
    them, num_remote = rows received)`."""
    blk = hrows + inline
    segs = np.empty((2 * world, 4), dtype=np.int64)
    ns, slot = 0, 0
    row2 = (world - 1) * blk if inline else 0
    for s in range(world):
        if s == me:
            continue
        n = srcs[s]
        n1 = min(n, inline)
        if inline:
            b0 = slot * blk
            segs[ns, 0], segs[ns, 1] = s, n1
            segs[ns, 2], segs[ns, 3] = b0 * row_bytes + 16, b0 + hrows
            ns += 1
            slot += 1
        if recv2[s]:
            segs[ns, 0], segs[ns, 1] = s, n - n1
            segs[ns, 2], segs[ns, 3] = row2 * row_bytes, row2 + recv2[s] - (n - n1)
            ns += 1
        row2 += recv2[s]
    return segs[:ns], row2


@njit(nogil=True, cache=True)
def recv_plan_at(work_addr, work_bytes, row_bytes, inline, hrows, me, per_rank, world,
                 num_tokens, top_k, meta_k, first, n_me, sends, ws_addr, ws_len, res_addr=0,
                 res_len=0):
    """`recv_plan` of the received bytes (`work`, by address) and this rank's own `n_me`
    tokens (sends `first..` of the workspace's plan; the workspace holds what
    `pack_send_at` and `read_headers_at` wrote).

    Returns `(res, its address, num_remote_bags, num_recv, offsets, gather, num_remote)`:
    `res` the one int64 array of what the dispatch hands on, laid out at `offsets`
    (`res_offsets`: origins, bag_rows, bag_offsets, tokens_per_expert, final_rows and
    final_offsets copied from the workspace, the received weights); `gather` and
    `num_remote` as `gather_at` takes them. `res` is the `res_len` int64 words at
    `res_addr` when they are room enough, else a new array."""
    (_, _, srcs, recv2, _, token_of, final_rows, final_offsets,
     meta) = _ws(ws_addr, ws_len, world, num_tokens, top_k, meta_k)
    if first < 0 or n_me < 0 or first + n_me > sends or sends > token_of.shape[0]:
        raise IndexError("torch backend: own sends out of the plan")
    work = carray(void_ptr(work_addr), (work_bytes,), np.uint8)
    segs, num_remote = _recv_segs(srcs, recv2, inline, hrows, row_bytes, me, world)
    bag_meta, bag_src, bag_row, num_remote_bags = _recv_bags(
        work, segs, meta[first:first + n_me], num_remote, me)
    counts = np.empty(per_rank * world, dtype=np.int64)
    num_recv = _recv_count(bag_meta, bag_src, me, per_rank, world, counts)
    num_bags = bag_meta.shape[0]
    offsets = res_offsets(num_recv, num_bags, per_rank, sends, num_tokens)
    _, o_br, o_bo, o_tpe, o_fr, o_fo, o_w, end = offsets
    if res_addr and res_len >= end:
        res = carray(void_ptr(res_addr), (res_len,), np.int64)
    else:
        res = np.empty(end, dtype=np.int64)
    at = res.ctypes.data
    gather = np.empty(num_recv, dtype=np.int64)
    _recv_fill(bag_meta, bag_src, bag_row, counts, me, per_rank, world, gather,
               carray(void_ptr(at), (3, num_recv), np.int64),
               carray(void_ptr(at + 8 * o_w), (num_recv,), np.int32),
               res[o_tpe:o_fr], res[o_br:o_bo], res[o_bo:o_tpe])
    res[o_fr:o_fo] = final_rows[:sends]
    res[o_fo:o_w] = final_offsets
    return res, at, num_remote_bags, num_recv, offsets, gather, num_remote


@njit(nogil=True, cache=True)
def gather_at(work_addr, work_bytes, x_addr, x_bytes, out_addr, out_bytes, gather, num_remote,
              row_bytes, world, num_tokens, top_k, meta_k, first, n_me, ws_addr, ws_len):
    """`gather_rows` by address: recv_x's rows (`gather`, from `recv_plan_at`) written to
    `out` (room for `out_bytes`), received rows from `work`, this rank's own (sends
    `first..first + n_me` of the workspace's plan) straight from x."""
    token_of = _ws(ws_addr, ws_len, world, num_tokens, top_k, meta_k)[5]
    if first < 0 or n_me < 0 or first + n_me > token_of.shape[0]:
        raise IndexError("torch backend: own sends out of the plan")
    work = carray(void_ptr(work_addr), (work_bytes,), np.uint8)
    x = carray(void_ptr(x_addr), (x_bytes,), np.uint8)
    out = carray(void_ptr(out_addr), (out_bytes,), np.uint8)
    gather_rows(work, x, gather, num_remote, token_of[first:first + n_me], out, row_bytes)


@njit(nogil=True, cache=True)
def recv_gather_at(work_addr, work_bytes, x_addr, x_bytes, out_addr, out_bytes, row_bytes,
                   inline, hrows, me, per_rank, world, num_tokens, top_k, meta_k, first, n_me,
                   sends, ws_addr, ws_len):
    """The receive side of a dispatch in one call: `recv_plan_at`, then `gather_at` into
    `out` (room for at least as many rows as the plan has pairs). Returns `recv_plan_at`'s
    first five: `(res, its address, num_remote_bags, num_recv, offsets)`."""
    res, at, num_remote_bags, num_recv, offsets, gather, num_remote = recv_plan_at(
        work_addr, work_bytes, row_bytes, inline, hrows, me, per_rank, world, num_tokens,
        top_k, meta_k, first, n_me, sends, ws_addr, ws_len)
    gather_at(work_addr, work_bytes, x_addr, x_bytes, out_addr, out_bytes, gather, num_remote,
              row_bytes, world, num_tokens, top_k, meta_k, first, n_me, ws_addr, ws_len)
    return res, at, num_remote_bags, num_recv, offsets


@njit(nogil=True, cache=True)
def source_order(rows, num_sources):
    """The indices i of `rows` (values in `[0, num_sources)`) grouped by `rows[i]`, ascending
    (a counting sort): the order in which to copy a gather so that each source row is read
    while still in cache for all its copies.

    recv_x is expert-major: a token routed to k local experts is copied k times, to places
    far apart. Copied in destination order, each source row is read again from memory for
    each copy; copied source by source, once. Batch 128 (1,057 rows of 14 KB from 256
    sources, one process, 2026-12-01): 0.88-0.90 ms against 1.33-1.36 ms in destination
    order, and 1.31-1.34 ms for one memcpy of the same 1,057 rows
    (docs/results/torch_backend.md)."""
    first = np.zeros(num_sources + 1, np.int64)
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= num_sources:
            raise IndexError("source_order: a row index outside [0, num_sources)")
        first[rows[i] + 1] += 1
    for s in range(num_sources):
        first[s + 1] += first[s]
    order = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        r = rows[i]
        order[first[r]] = i
        first[r] += 1
    return order


@njit(nogil=True, cache=True)
def gather_rows(work, x, gather, num_remote, own_tokens, out, rw):
    """Row i of `out` = row `gather[i]` of `work`, or row `own_tokens[gather[i] - num_remote]`
    of `x` for this rank's own tokens (`gather[i] >= num_remote`): recv_x in one pass, own
    rows straight from x, source by source (`source_order`). Flat arrays of one word type,
    `rw` words a row."""
    n_src = num_remote
    for i in range(gather.shape[0]):
        n_src = max(n_src, gather[i] + 1)
    for i in source_order(gather, n_src):
        g = gather[i]
        src = work if g < num_remote else x
        if g >= num_remote:
            g = own_tokens[g - num_remote]
        copy_row(out, i * rw, src, g * rw, rw)
    return out


@njit(nogil=True, cache=True)
def final_sums_16(back_rows, own_rows, final_rows, final_offsets, num_back, y):
    """Each token's <= P partial rows (16-bit: bfloat16 bits as uint16, fp16 bits as int16)
    summed in fp32 in rank order and rounded once as `embedding_bag` does it on CPU (bf16:
    to nearest, ties away from zero; fp16: to nearest even), so the bits are those the
    backend gave before: row r < `num_back` of the combine work buffer is `back_rows[r]`
    (received), row r >= `num_back` is `own_rows[r - num_back]` (this rank's own partials,
    read where they were made, not copied).

    `_CHUNK` elements at a time, the accumulator in L1 (as `bag_sums`): whole rows through
    fp32 scratch took 0.68 ms for 128 tokens x 2 partials, 0.46 ms so (same bits)."""
    num_tokens, hidden = y.shape
    end = final_rows.shape[0]
    acc = np.empty(_CHUNK, dtype=np.float32)
    ab = acc.view(np.uint32)
    for t in range(num_tokens):
        q0 = final_offsets[t]
        q1 = final_offsets[t + 1] if t + 1 < num_tokens else end
        out = y[t]
        for c0 in range(0, hidden, _CHUNK):
            n = min(_CHUNK, hidden - c0)
            a = acc[:n]                  # views from 0: indices provably >= 0, loops vectorize
            for h in range(n):
                a[h] = 0.0
            for q in range(q0, q1):
                r = final_rows[q]
                s = (back_rows[r] if r < num_back else own_rows[r - num_back])[c0:c0 + n]
                for h in range(n):
                    a[h] += _widen(s[h])
            _final_store(out[c0:c0 + n], a, ab, n)
    return y


def _final_store(out, acc, acc_bits, n):
    """`out[:n]` = the fp32 sums `acc` (`acc_bits` as uint32) rounded as `embedding_bag`
    rounds its sums on CPU: bf16 bits (uint16 `out`) to nearest, ties away from zero, NaN
    -> 0x7FC0; fp16 bits (int16 `out`) to nearest even, as `_store` does."""


@overload(_final_store, inline="always")
def _final_store_impl(out, acc, acc_bits, n):
    if out.dtype == types.int16:
        return lambda out, acc, acc_bits, n: _store(out, acc, acc_bits, n)

    def store_bf16(out, acc, acc_bits, n):
        for h in range(n):
            b = acc_bits[h]
            if (b & 0x7FFFFFFF) > 0x7F800000:
                out[h] = 0x7FC0
            else:
                out[h] = np.uint16((np.uint64(b) + 0x8000) >> 16)
    return store_bf16


@njit(nogil=True, cache=True)
def final_sums_f32(back_rows, own_rows, final_rows, final_offsets, num_back, y):
    """`final_sums_16` for float32 partials: summed in fp32 in rank order into `y`."""
    num_tokens, hidden = y.shape
    end = final_rows.shape[0]
    for t in range(num_tokens):
        out = y[t]
        out[:] = 0.0
        q1 = final_offsets[t + 1] if t + 1 < num_tokens else end
        for q in range(final_offsets[t], q1):
            r = final_rows[q]
            src = back_rows[r] if r < num_back else own_rows[r - num_back]
            for h in range(hidden):
                out[h] += src[h]
    return y


#: elements of a row the bag sums take at a time: accumulator and widened rows stay in L1
#: (whole 7168-element rows through fp32 scratch ran at L2 speed, ~3x slower)
_CHUNK = 512


def _widen(v):
    """A row element as float32: bfloat16 bits (uint16) or fp16 bits (int16) widened,
    float32 as it is."""


@overload(_widen, inline="always")
def _widen_impl(v):
    if v == types.uint16:
        return lambda v: bits_to_f32(np.uint32(v) << np.uint32(16))   # a register bitcast
    if v == types.int16:
        return lambda v: f16_to_f32(np.uint16(v))      # the CPU's conversion where it has one
    if v == types.float32:
        return lambda v: v
    return None


def _store(out, acc, acc_bits, n):
    """`out[:n]` = the fp32 sums `acc[:n]` in `out`'s element type: bfloat16 bits (uint16
    `out`) or fp16 bits (int16) rounded to nearest even (`acc_bits` is `acc` as uint32),
    float32 as they are."""


@overload(_store, inline="always")
def _store_impl(out, acc, acc_bits, n):
    if out.dtype == types.uint16:
        def store_bf16(out, acc, acc_bits, n):
            for h in range(n):
                out[h] = _bf16_bits(acc_bits[h])
        return store_bf16
    if out.dtype == types.int16:
        def store_f16(out, acc, acc_bits, n):
            for h in range(n):
                out[h] = np.int16(f32_bits_to_f16(acc_bits[h]))
        return store_f16

    def store_f32(out, acc, acc_bits, n):
        out[:n] = acc[:n]
    return store_f32


@njit(nogil=True, cache=True)
def bag_sums(rows, weights, weighted, bag_rows, bag_offsets, j0, j1, out):
    """Combine's expert-side sums: `out[j - j0]` = the sum over bag j's slots (rows
    `bag_rows[bag_offsets[j]:...]` of `rows`) of `weights[row] * row` (or `row`, not
    `weighted`) in fp32, slot order, rounded once to `out`'s type: what the oracle computes
    for the slots a rank holds. `rows`/`out` are bfloat16 bits (uint16) or fp16 bits
    (int16), rounded to nearest even, or float32. fp32 weights as they are (not split into
    16-bit halves as `embedding_bag` needs them)."""
    hidden = rows.shape[1]
    acc = np.empty(_CHUNK, dtype=np.float32)
    ab = acc.view(np.uint32)
    end, num = bag_rows.shape[0], bag_offsets.shape[0]
    for j in range(j0, j1):
        q0 = bag_offsets[j]
        q1 = bag_offsets[j + 1] if j + 1 < num else end
        o = out[j - j0]
        for c0 in range(0, hidden, _CHUNK):
            n = min(_CHUNK, hidden - c0)
            acc[:n] = 0.0
            q = q0
            while q + 3 < q1:     # four slots a pass, added in slot order: the same sums
                r0, r1, r2, r3 = bag_rows[q], bag_rows[q + 1], bag_rows[q + 2], bag_rows[q + 3]
                s0, s1 = rows[r0, c0:c0 + n], rows[r1, c0:c0 + n]
                s2, s3 = rows[r2, c0:c0 + n], rows[r3, c0:c0 + n]
                w0 = weights[r0] if weighted else np.float32(1.0)
                w1 = weights[r1] if weighted else np.float32(1.0)
                w2 = weights[r2] if weighted else np.float32(1.0)
                w3 = weights[r3] if weighted else np.float32(1.0)
                for h in range(n):
                    acc[h] = (((acc[h] + w0 * _widen(s0[h])) + w1 * _widen(s1[h]))
                              + w2 * _widen(s2[h])) + w3 * _widen(s3[h])
                q += 4
            while q + 1 < q1:     # then two
                r0, r1 = bag_rows[q], bag_rows[q + 1]
                s0, s1 = rows[r0, c0:c0 + n], rows[r1, c0:c0 + n]
                w0 = weights[r0] if weighted else np.float32(1.0)
                w1 = weights[r1] if weighted else np.float32(1.0)
                for h in range(n):
                    acc[h] = (acc[h] + w0 * _widen(s0[h])) + w1 * _widen(s1[h])
                q += 2
            if q < q1:
                r0 = bag_rows[q]
                s0 = rows[r0, c0:c0 + n]
                w0 = weights[r0] if weighted else np.float32(1.0)
                for h in range(n):
                    acc[h] += w0 * _widen(s0[h])
            _store(o[c0:c0 + n], acc, ab, n)
    return out


# -- the same kernels on tensors' memory by address -------------------------------------------
# A tensor's memory reaches numpy through `view(word).numpy()` (bf16 has no numpy type), and
# a result comes back through `torch.from_numpy(..).view(dtype)`: a few µs per call each when
# warm, 10-20 µs at batch 1 between gloo collectives on a slow host. These take the address
# of a contiguous CPU tensor the caller holds (Buffer checked it) and its size instead.

@njit(nogil=True, cache=True)
def _bag_sums_at(rows, weights_addr, weighted, bag_rows_addr, bag_offsets_addr, num_pairs,
                 num_bags, j0, j1, out_addr):
    """`bag_sums` of bags `j0..j1` over `rows`, the bags (`num_pairs` weights and bag rows,
    `num_bags` offsets) and `out` (`[j1 - j0, hidden]`) by address; a bag row outside
    `rows` or an offset outside the bag rows raises."""
    num_rows, hidden = rows.shape
    if not 0 <= j0 <= j1 <= num_bags:
        raise IndexError("torch backend: bags out of the plan")
    weights = carray(void_ptr(weights_addr), (num_pairs,), np.float32)
    bag_rows = carray(void_ptr(bag_rows_addr), (num_pairs,), np.int64)
    bag_offsets = carray(void_ptr(bag_offsets_addr), (num_bags,), np.int64)
    for j in range(j0, j1):
        q1 = bag_offsets[j + 1] if j + 1 < num_bags else num_pairs
        if not 0 <= bag_offsets[j] <= q1 <= num_pairs:
            raise IndexError("torch backend: a bag out of the plan")
        for q in range(bag_offsets[j], q1):
            if not 0 <= bag_rows[q] < min(num_rows, num_pairs):
                raise IndexError("torch backend: a bag row out of expert_out")
    out = carray(void_ptr(out_addr), (j1 - j0, hidden), rows.dtype)
    bag_sums(rows, weights, weighted, bag_rows, bag_offsets, j0, j1, out)


#: a partial row type by code, for the by-address kernels and the torch door's block
KIND_F32, KIND_BF16, KIND_F16 = 0, 1, 2


@njit(nogil=True, cache=True)
def bag_sums_at(kind, rows_addr, num_rows, hidden, weights_addr, weighted, bag_rows_addr,
                bag_offsets_addr, num_pairs, num_bags, j0, j1, out_addr):
    """`bag_sums` over `[num_rows, hidden]` rows at `rows_addr` of the type `kind` names
    (`KIND_*`; 16-bit rows as their bits), all by address (`_bag_sums_at`)."""
    args = (weights_addr, weighted, bag_rows_addr, bag_offsets_addr, num_pairs, num_bags,
            j0, j1, out_addr)
    if kind == KIND_BF16:
        _bag_sums_at(carray(void_ptr(rows_addr), (num_rows, hidden), np.uint16), *args)
    elif kind == KIND_F16:
        _bag_sums_at(carray(void_ptr(rows_addr), (num_rows, hidden), np.int16), *args)
    else:
        _bag_sums_at(carray(void_ptr(rows_addr), (num_rows, hidden), np.float32), *args)


#: the output dtypes `bag_sums` writes (16-bit ones as their bits), by the word its rows are
#: read as (bf16 and fp16 differ in type so that one kernel compiles for each)
BAG_WORDS = {torch.bfloat16: torch.uint16, torch.float16: torch.int16,
             torch.float32: torch.float32}


def bags_by_token(token: np.ndarray, slot: np.ndarray, num_tokens: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """`(bag_rows, bag_offsets)` for `bag_sums`: bag t is the rows i with `token[i] == t`,
    in slot order, for t in `[0, num_tokens)` (an empty bag sums to zeros)."""
    bag_rows = np.lexsort((slot, token))
    return bag_rows, np.searchsorted(token[bag_rows], np.arange(num_tokens))


def bag_sums_into(rows: torch.Tensor, weights: np.ndarray, weighted: bool,
                  bag_rows: np.ndarray, bag_offsets: np.ndarray,
                  out: torch.Tensor) -> torch.Tensor:
    """`bag_sums` of every bag into `out` (`[bags, hidden]`) from `rows` (`[N, hidden]`),
    contiguous CPU tensors of one `BAG_WORDS` dtype; returns `out`."""
    word = BAG_WORDS[out.dtype]
    bag_sums(rows.view(word).numpy(), weights, bool(weighted), bag_rows, bag_offsets, 0,
             len(bag_offsets), out.view(word).numpy())
    return out


@njit(nogil=True, cache=True)
def _final_args(back_addr, num_back, own_addr, num_own, hidden, final_rows_addr,
                final_offsets_addr, sends, num_tokens, y_addr, word):
    """The arrays of `final_sums_*` by address: the received and own partial rows and y
    (`[.., hidden]` of `word`), and the source-side plan (`sends` rows, `num_tokens`
    offsets), checked: every row inside the combine work buffer, offsets ascending in it."""
    final_rows = carray(void_ptr(final_rows_addr), (sends,), np.int64)
    final_offsets = carray(void_ptr(final_offsets_addr), (num_tokens,), np.int64)
    prev = 0
    for t in range(num_tokens):
        if not prev <= final_offsets[t] <= sends:
            raise IndexError("torch backend: a token's partials out of the plan")
        prev = final_offsets[t]
    for q in range(sends):
        if not 0 <= final_rows[q] < num_back + num_own:
            raise IndexError("torch backend: a partial row out of the combine buffer")
    return (carray(void_ptr(back_addr), (num_back, hidden), word),
            carray(void_ptr(own_addr), (num_own, hidden), word), final_rows, final_offsets,
            carray(void_ptr(y_addr), (num_tokens, hidden), word))


@njit(nogil=True, cache=True)
def final_sums_at(kind, back_addr, num_back, own_addr, num_own, hidden, final_rows_addr,
                  final_offsets_addr, sends, num_tokens, y_addr):
    """`final_sums_16` / `final_sums_f32` with every array by address (`_final_args`), the
    partials and y of the type `kind` names (`KIND_*`)."""
    args = (back_addr, num_back, own_addr, num_own, hidden, final_rows_addr,
            final_offsets_addr, sends, num_tokens, y_addr)
    if kind == KIND_BF16:
        back, own, rows, offsets, y = _final_args(*args, np.uint16)
        final_sums_16(back, own, rows, offsets, num_back, y)
    elif kind == KIND_F16:
        back, own, rows, offsets, y = _final_args(*args, np.int16)
        final_sums_16(back, own, rows, offsets, num_back, y)
    else:
        back, own, rows, offsets, y = _final_args(*args, np.float32)
        final_sums_f32(back, own, rows, offsets, num_back, y)
