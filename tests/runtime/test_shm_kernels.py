"""Single-process checks of the shm building blocks: block formats, atomics, kernels, plans."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from ubep.plan.blocks import SENTINEL, BlockFormat, sentinel_refusal
from ubep.plan.fastplan import STATIC, count_experts, map_worker
from ubep.runtime.shm.atomics import fetch_add, load_acquire, store_release
from ubep.runtime.shm.kernels.dispatch import offsets, recv_rows, send_rows
from ubep.runtime.shm.kernels.local import barrier_arrive, poll_at_least, publish
from ubep.runtime.shm.kernels.records import FMT_TFF, write_record
from ubep.runtime.shm.kernels.sentinel import arm_sentinels
from ubep.runtime.shm.kernels.slots import poll_counts, send_counts, write_batch_flags
from ubep.runtime.shm.region import (
    L_DROWS,
    L_DSTRIDE,
    L_DWIN_OFF,
    L_SIZE,
    META_BYTES,
    region_layout,
)


def _plan_one_worker(idx: np.ndarray, num_experts: int):
    """(sends, window positions, counts) of one static worker on one rank: the mapper's."""
    counts = np.zeros(num_experts, np.int64)
    count_experts(idx, counts)
    sends, _, pos, _ = map_worker(idx, counts, num_experts, np.zeros(1, np.int64),
                                  np.arange(num_experts, dtype=np.int64), STATIC, 1, 1, 0)
    return sends, pos, counts


# -- block formats (pure) ---------------------------------------------------------------------


@given(sync=st.sampled_from(["sw", "tff", "dc", "sp"]),
       block=st.integers(2, 64).map(lambda n: 8 * n), record=st.integers(1, 20000))
def test_blocks_hold_the_record_and_efficiency_is_bounded(sync, block, record):
    f = BlockFormat(sync, block)
    n = f.num_blocks(record)
    assert (n - 1) * f.payload_per_block < record <= n * f.payload_per_block
    eff = f.efficiency(record)
    bound = (block - 8) / block if sync == "tff" else 1.0   # tff: a flag word per block
    assert 0 < eff <= bound
    assert eff == record / (n * block)
    assert all(p % 8 == 0 and p < n * block for p in f.marker_positions(record))


def test_tff_efficiency_matches_the_paper_format():
    f = BlockFormat("tff", 512)
    assert f.payload_per_block == 504
    assert f.efficiency(504 * 10) == pytest.approx(504 / 512)
    assert BlockFormat("sp", 512).efficiency(512 * 3) == 1.0


@pytest.mark.parametrize("block", [0, 8, 12, 100, True])
def test_bad_block_sizes_are_refused(block):
    with pytest.raises(ValueError, match="block_bytes"):
        BlockFormat("tff", block)


def test_sentinel_is_nan_in_every_float_it_guards_and_refusal_names_tff():
    raw = torch.tensor(list(SENTINEL.to_bytes(8, "little")), dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.isnan(raw.view(dtype)).all()
        assert sentinel_refusal(str(dtype)) is None
    for name in ("int8", "float8_e4m3fn", "uint8"):
        assert "tff" in sentinel_refusal(name)


# -- atomics -----------------------------------------------------------------------------------
def test_spin_on_acquire_load_sees_a_store_from_another_thread():
    word = np.zeros(8, np.int64)
    addr = word.ctypes.data

    def later():
        time.sleep(0.05)
        store_release_py(addr, 7)

    t = threading.Thread(target=later)
    t.start()
    deadline = time.monotonic() + 10
    seen = False
    while time.monotonic() < deadline and not seen:
        seen = poll_at_least(addr, 7, 1000)   # a hoisted load would never see it
    t.join()
    assert seen and word[0] == 7


def store_release_py(addr, v):
    publish(addr, v)


def test_fetch_add_counts_every_arrival_from_threads():
    word = np.zeros(8, np.int64)
    addr = word.ctypes.data

    def arrive():
        for _ in range(1000):
            barrier_arrive(addr)

    ts = [threading.Thread(target=arrive) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert word[0] == 4000


@njit
def _store_add_load(addr):
    store_release(addr, 41)
    old = fetch_add(addr, 1)
    return old, load_acquire(addr)


def test_intrinsics_store_add_and_load_a_word():
    word = np.zeros(2, np.int64)
    assert _store_add_load(word.ctypes.data + 8) == (41, 42)
    assert word.tolist() == [0, 42]          # that word, and only that word


# -- records through a local region --------------------------------------------------------------
def _region(sync, block, hidden=13, tokens=4, top_k=2):
    fmt = BlockFormat(sync, block)
    lay = region_layout(world=1, experts_per_rank=2, max_workers=1, hidden=hidden,
                        max_tokens=tokens, max_top_k=top_k, fmt=fmt)
    mem = np.zeros(int(lay[L_SIZE]) + 64, np.uint8)
    base = (mem.ctypes.data + 63) // 64 * 64
    bases = np.array([base], np.int64)
    if sync == "sp":
        arm_sentinels(base, lay)
    return mem, lay, base, bases


@pytest.mark.parametrize("sync", ["sw", "tff", "dc", "sp"])
@pytest.mark.parametrize("block", [16, 64, 512])
def test_dispatch_round_trip_through_one_rank_region(sync, block):
    mem, lay, base, bases = _region(sync, block)
    idx = np.array([[0, 1], [1, -1], [-1, -1], [0, 1]], np.int64)
    w = np.random.default_rng(0).random((4, 2)).astype(np.float32)
    x = np.random.default_rng(1).integers(0, 255, (4, 26), dtype=np.uint8)   # 13 bf16
    for epoch in (1, 2, 3):
        sends, pos, counts = _plan_one_worker(idx, 2)
        send_counts(bases, lay, 0, epoch, counts, 1, 0, 0, 0, 1)
        cs = np.zeros(1, np.int64)
        send_rows(bases, lay, 0, epoch, x, idx, w, sends, pos, counts, cs)
        write_batch_flags(bases, lay, 0, 0, epoch, 0, cs)
        rc = np.zeros((1, 2), np.int64)
        meta = np.zeros((1, 3), np.int64)
        got = np.zeros(1, np.int8)
        assert poll_counts(base, lay, epoch, 0, 1, rc, meta, got, 1) == 0
        assert rc.tolist() == [[2, 3]] and meta[0, 0] == 1
        out_start = np.zeros((1, 2), np.int64)
        tpe = np.zeros(2, np.int64)
        n = offsets(rc, out_start, tpe)
        out_x = np.zeros((n, 26), np.uint8)
        out_w = np.zeros(n, np.float32)
        ints = np.zeros((3, n), np.int64)
        done = np.zeros(n, np.uint8)
        batch = np.zeros(1, np.int64)
        assert recv_rows(base, lay, epoch, rc, meta, out_start, 0, n, done, batch, out_x,
                           out_w, ints[0], ints[1], ints[2], 1) == 0
        # expert 0: tokens 0, 3; expert 1: tokens 0, 1, 3
        assert ints[1].tolist() == [0, 3, 0, 1, 3] and ints[2].tolist() == [0, 0, 1, 0, 1]
        np.testing.assert_array_equal(out_x, x[[0, 3, 0, 1, 3]])
        np.testing.assert_array_equal(out_w, w[[0, 3, 0, 1, 3], [0, 0, 1, 0, 1]])
        # the next epoch must not see these rows as new: nothing was sent for epoch + 1
        if sync in ("tff", "sp"):
            done[:] = 0
            assert recv_rows(base, lay, epoch + 2, rc, meta, out_start, 0, n, done, batch,
                               out_x, out_w, ints[0], ints[1], ints[2], 1) == n
    del mem


def _dispatch_once(lay, base, bases, epoch, x, idx, w, send=True):
    """One dispatch through a 1-rank region; returns rows still missing after one poll."""
    sends, pos, counts = _plan_one_worker(idx, 2)
    if send:
        send_counts(bases, lay, 0, epoch, counts, 1, 0, 0, 0, 1)
        cs = np.zeros(1, np.int64)
        send_rows(bases, lay, 0, epoch, x, idx, w, sends, pos, counts, cs)
        write_batch_flags(bases, lay, 0, 0, epoch, 0, cs)
    rc = counts.reshape(1, 2)
    out_start = np.zeros((1, 2), np.int64)
    n = offsets(rc, out_start, np.zeros(2, np.int64))
    out_x = np.zeros((n, x.shape[1]), np.uint8)
    ints = np.zeros((3, n), np.int64)
    left = recv_rows(base, lay, epoch, rc, np.array([[1, 0, 0]], np.int64), out_start, 0, n,
                     np.zeros(n, np.uint8), np.zeros(1, np.int64), out_x, np.zeros(n, np.float32),
                     ints[0], ints[1], ints[2], 1)
    return left, out_x, ints


@pytest.mark.parametrize("sync", ["tff", "sp"])
@pytest.mark.parametrize("block", [16, 64, 512])
def test_rows_packed_at_another_size_leave_no_flag_or_marker_for_the_next_call(sync, block):
    """A parity's window is reused by calls of any row size, each packing its records at its
    own size: after rows of one size whose every 8-byte word holds a later epoch, rows of
    another size not yet sent must not look arrived (flags and markers sit on one block
    grid), then arrive intact."""
    mem, lay, base, bases = _region(sync, block, hidden=37)
    idx = np.array([[0, 1], [1, 0], [0, 1], [1, 0]], np.int64)
    w = np.ones((4, 2), np.float32)
    sizes = (148, 74, 37, 148, 26, 74)
    for k, size in enumerate(sizes):
        e = 2 * k + 2                               # one parity: the same window every call
        words = np.array([e, e + 2, e + 4], np.int64).view(np.uint8)
        x = np.resize(words, (4, size)).copy()
        assert _dispatch_once(lay, base, bases, e, x, idx, w, send=False)[0] == 8
        left, out_x, ints = _dispatch_once(lay, base, bases, e, x, idx, w)
        assert left == 0
        np.testing.assert_array_equal(out_x, x[ints[1]])
    del mem


def test_dc_detects_a_changed_marker_word():
    mem, lay, base, bases = _region("dc", 64)
    idx = np.array([[0, 1]], np.int64)
    w = np.ones((1, 2), np.float32)
    x = np.arange(26, dtype=np.uint8)[None, :]
    sends, pos, counts = _plan_one_worker(idx, 2)
    send_counts(bases, lay, 0, 1, counts, 1, 0, 0, 0, 1)
    cs = np.zeros(1, np.int64)
    send_rows(bases, lay, 0, 1, x, idx, w, sends, pos, counts, cs)
    write_batch_flags(bases, lay, 0, 0, 1, 0, cs)
    # corrupt the first row's marker word (last 8 bytes of its first block), epoch 1 = parity 1
    marker = int(lay[L_DWIN_OFF] + lay[L_DROWS] * lay[L_DSTRIDE]) + 64 - 8
    mem_view = np.frombuffer(mem, np.uint8)
    off = base - mem.ctypes.data + marker
    mem_view[off] ^= 1
    rc = np.array([[1, 1]], np.int64)
    meta = np.array([[1, 0, 0]], np.int64)
    out_start = np.array([[0, 1]], np.int64)
    batch = np.zeros(1, np.int64)
    args = (np.zeros((2, 26), np.uint8), np.zeros(2, np.float32), np.zeros(2, np.int64),
            np.zeros(2, np.int64), np.zeros(2, np.int64))
    assert recv_rows(base, lay, 1, rc, meta, out_start, 0, 2, np.zeros(2, np.uint8), batch,
                       *args, 4) == 2
    assert batch[0] == -1
    mem_view[off] ^= 1
    assert recv_rows(base, lay, 1, rc, meta, out_start, 0, 2, np.zeros(2, np.uint8), batch,
                       *args, 1) == 0


def test_copy_kernels_do_not_call_memcpy():
    from numba import njit

    # a fresh, uncached compile (cached code cannot be inspected)
    fresh = njit(nogil=True)(write_record.py_func)
    mem, lay, base, bases = _region("tff", 64)
    head = np.zeros(16, np.uint8)
    body = np.arange(300, dtype=np.int64).astype(np.uint8)
    fresh(base, 64, 56, FMT_TFF, head, 16, body, 300, 1, 0)
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "memcpy" not in asm and "memmove" not in asm
    assert "pause" not in asm  # sanity: we are looking at the writer, not a poll loop
    del mem





@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 14336, 3 * 4096 + 5])
@pytest.mark.parametrize("gap", [0, 1, 16, 31, 63, 64, 4080])
def test_memcpy_at_copies_every_byte_at_any_page_offset(n, gap):
    # a destination 1-63 bytes past the source modulo 4 KiB is copied in ALIAS_PIECE pieces
    # (rep movsb's slow case on AMD Zen 3); every offset must give the same bytes
    from ubep.runtime.shm.atomics import memcpy_at

    @njit
    def copy(d, s, k):
        memcpy_at(d, s, k)

    src = np.random.default_rng(n + gap).integers(0, 256, n + 8192, dtype=np.uint8)
    dst = np.zeros(n + 2 * 8192, np.uint8)
    s_at = -src.ctypes.data % 4096          # the source on a page boundary
    d_at = -dst.ctypes.data % 4096 + 4096 + gap
    copy(dst.ctypes.data + d_at, src.ctypes.data + s_at, n)
    assert np.array_equal(dst[d_at:d_at + n], src[s_at:s_at + n])
    assert not dst[:d_at].any() and not dst[d_at + n:].any()


def test_a_dispatch_record_is_a_meta_bytes_header_then_the_row():
    mem, lay, base, bases = _region("tff", 512)
    idx = np.array([[-1, 1]], np.int64)
    w = np.array([[0.5, 0.75]], np.float32)
    x = (np.arange(26, dtype=np.uint8) + 100)[None, :]
    sends, pos, counts = _plan_one_worker(idx, 2)
    send_counts(bases, lay, 0, 1, counts, 1, 0, 0, 0, 1)
    send_rows(bases, lay, 0, 1, x, idx, w, sends, pos, counts, np.zeros(1, np.int64))
    at = mem.tobytes().find(x[0].tobytes())
    assert at >= META_BYTES
    header = mem[at - META_BYTES:at]
    token, slot = header[:8].view(np.int32).tolist()
    assert (token, slot) == (0, 1) and header[8:12].view(np.float32)[0] == np.float32(0.75)
    del mem


def test_combine_cast_matches_torch_outside_nan_payloads():
    from ubep.runtime.shm.elements import cast_rows as _cast_rows

    g = torch.Generator().manual_seed(0)
    y = torch.randn(16, 512, generator=g) * torch.logspace(-40, 38, 512)
    y[0, :5] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.3895314e38])
    raw = torch.randint(0, 2**32, (16, 512), generator=g).to(torch.int32).view(torch.float32)
    for t in (y.float(), raw):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got, want = _cast_rows(t.numpy().copy(), dtype), t.to(dtype)
            same = got.view(torch.uint8).reshape(16, -1) == want.view(torch.uint8).reshape(16, -1)
            nan = torch.isnan(want.float()).repeat_interleave(want.element_size(), dim=1)
            assert bool((same | nan).all())
            assert torch.isnan(got.float()).equal(torch.isnan(want.float()))


def test_direct_rows_copied_by_memcpy_then_fenced():
    """The direct path's row copy (here its combine copy-in) goes through memcpy, whose
    string stores x86 may make visible out of order, so an `sfence` must follow it before
    the word that publishes the rows; the bytes land where they should."""
    import platform

    from numba import njit

    from ubep.runtime.shm.direct.kernels import copy_rows_for_peers

    fresh = njit(nogil=True)(copy_rows_for_peers.py_func)   # uncached: inspectable
    rb, n = 24, 5
    src = np.arange(rb * n, dtype=np.uint8)
    dst = np.zeros(rb * n, np.uint8)
    src_rank = np.array([1, 0, 0, 1, 0], np.int64)      # rows of rank 0 (me) stay
    fresh(dst.ctypes.data, src.ctypes.data, rb, src_rank, 0, n)
    rows, got = src.reshape(n, rb), dst.reshape(n, rb)
    assert np.array_equal(got[src_rank == 1], rows[src_rank == 1])
    assert not got[src_rank == 0].any()
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "memcpy" in asm
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "sfence" in asm


def _f16_kernels():
    """Loops over the scalar fp16 conversions: the one combine uses here and the integer one
    used where the CPU has no fp16 instructions (both must match torch bit for bit)."""
    from numba import njit

    from ubep.runtime.shm.kernels.combine import (
        f16_to_f32,
        f16_to_f32_soft,
        f32_bits_to_f16,
        f32_to_f16_soft,
    )

    def each(conv):
        @njit
        def loop(a, out):
            for i in range(a.shape[0]):
                out[i] = conv(a[i])
        return loop

    return [each(f16_to_f32), each(f16_to_f32_soft)], [each(f32_bits_to_f16),
                                                        each(f32_to_f16_soft)]


def test_fp16_conversions_match_torch_bit_for_bit():
    """Combine sums fp16 rows in fp32 and rounds back: every fp16 value up (NaNs included:
    quieted, payload kept, as torch does), and down: every fp16 value, each midpoint between
    neighbours and one ulp either side (the ties), overflow, subnormals and a sweep of all fp32
    bit patterns."""
    up_kernels, down_kernels = _f16_kernels()
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want_up = torch.from_numpy(h.view(np.int16)).view(torch.float16).float().numpy()
    for up in up_kernels:
        got = np.empty(h.shape, np.float32)
        up(h, got)
        assert np.array_equal(got.view(np.uint32), want_up.view(np.uint32))

    fin = np.unique(want_up[np.isfinite(want_up)])
    mids = ((fin[:-1].astype(np.float64) + fin[1:]) / 2).astype(np.float32).view(np.uint32)
    sweep = np.arange(0, 1 << 32, 8191, dtype=np.uint64).astype(np.uint32)
    u = np.concatenate([want_up.view(np.uint32), mids - 1, mids, mids + 1, sweep,
                        np.float32([65504, 65519.99, 65520, 1e9, 2**-25, 2**-24 * 1.5,
                                    -2**-14]).view(np.uint32)])
    want_down = torch.from_numpy(u.view(np.float32)).to(torch.float16).view(torch.int16)
    for down in down_kernels:
        got = np.empty(u.shape, np.uint16)
        down(u, got)
        assert np.array_equal(got, want_down.numpy().view(np.uint16))
