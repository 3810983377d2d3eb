"""The torch.distributed backend against the oracle: bit-exact dispatch, P = 2, 3, 4; combine
bit-exact to its contract (per-rank partial sums, `check_case(contract="torch")`) on the CPU
path, within `TORCH_DEVICE_PATH_ULPS` of it on the device path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.testing import TORCH_DEVICE_PATH_ULPS, Case, check_case, run_case, run_ranks


def _cases(world: int) -> list[Case]:
    T = tuple(5 + 3 * r for r in range(world))
    E = 4 * world
    cases = [
        Case(E, 16, 4, T, "uniform", "bf16", seed=1),
        Case(E, 16, 4, T, "skewed", "bf16", seed=2),
        Case(E, 16, 2, T, "one_expert", "fp32", seed=3),
        Case(E, 16, 4, (0,) + T[1:], "uniform", "fp16", seed=4),          # a rank with T = 0
        Case(E, 16, 3, T, "unrouted", "bf16", seed=5),                     # every slot -1
        Case(E, 16, 4, T, "partial", "fp8", seed=6),
        Case(E, 8, 4, T, "uniform", "int8", seed=7),
        Case(E, 8, 4, T, "uniform", "uint8", seed=8, weighted=False),
        Case(2 * world, 24, 2, T, "uniform", "fp32", seed=9),             # 2 experts per rank
    ]
    return cases


def _run_cases(rank, world, cases, host_moves_rows=True, inline_bytes=None):
    import ubep
    from ubep.runtime import torch_backend

    torch_backend.HOST_MOVES_ROWS = host_moves_rows
    if inline_bytes is not None:
        torch_backend._INLINE_BYTES = inline_bytes

    outs = []
    for case in cases:
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend="torch") as buf:
            outs.append(run_case(buf, case, rank))
    return outs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_backend_matches_reference(world):
    cases = _cases(world)
    per_rank = run_ranks(_run_cases, world, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(world)], contract="torch")


@pytest.mark.parametrize("inline_bytes", [0, 160])
def test_torch_backend_two_phase_dispatch(inline_bytes):
    """Tokens beyond what dispatch's first collective carries inline take the second:
    0 = none inline (a count exchange, then everything); 160 bytes over 2 peers = 1 token
    per peer inline for 32-byte rows (bf16), 4 for fp8, 9 for int8, none for fp32."""
    cases = _cases(3)
    per_rank = run_ranks(_run_cases, 3, cases, True, inline_bytes, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(3)], contract="torch")


@pytest.mark.parametrize("inline_bytes", [None, 0])
def test_torch_backend_device_path_on_cpu(inline_bytes):
    """The torch ops a GPU group's rows take (index_select, copies to the device, only the
    routing words to the host), run on CPU; tokens inline and in a second collective."""
    cases = _cases(2)
    per_rank = run_ranks(_run_cases, 2, cases, False, inline_bytes, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(2)], contract="torch",
                   ulps=TORCH_DEVICE_PATH_ULPS)


def _reuse(rank, world, cases):
    """One Buffer, many calls with changing routing and batch sizes."""
    import ubep
    from ubep.runtime import torch_backend

    torch_backend._INLINE_BYTES = 3 * 8 * 2    # up to 3 tokens inline: batches over- and under

    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=16, backend="torch") as buf:
        return [run_case(buf, c, rank) for c in cases]


def test_torch_backend_buffer_reuse():
    cases = [Case(8, 8, 2, (s % 7, (3 * s) % 11), "uniform", "bf16", seed=s) for s in range(12)]
    per_rank = run_ranks(_reuse, 2, cases)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(2)], contract="torch")


def _bytes_per_peer(rank, world):
    """Two dispatch+combine calls; what the collectives carried, and the routings."""
    import torch

    import ubep
    from ubep.testing import make_routing, make_tokens

    out = []
    with ubep.Buffer(num_experts=4 * world, hidden=8192, max_tokens_per_rank=8,
                     max_top_k=4, backend="torch") as buf:
        for call, tokens in enumerate((7, 2)):
            idx, w = make_routing(tokens, 4, 4 * world, kind="uniform", seed=11 + rank + call)
            x = make_tokens(rank, tokens, 8192, torch.float32, seed=3)
            res = buf.dispatch(x, idx, w)
            buf.combine(res.recv_x, res.handle)
            out.append((idx, res.stats.extra["collectives"], buf.last_stats.extra["collectives"]))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_torch_backend_sends_each_token_once_per_rank(world):
    """A token crosses to a rank once (its row + routing words), however many of its
    experts live there, and one partial row per (token, rank) comes back. Rows of 32 KiB:
    on 2 ranks one token per peer may ride inline in the first collective (64 KiB budget),
    on 3 none (the first collective exchanges counts); the rest go in a second collective
    that runs only when some rank has more for a peer. The next call inlines the largest
    count of this one if it fit, else nothing."""
    out = run_ranks(_bytes_per_peer, world)
    row_bytes, top_k = 8192 * 4, 4
    meta_bytes = 4 * (1 + 2 * top_k)
    counts = [[[int(((idx // 4) == d).any(1).sum()) for d in range(world)]
               for idx, _, _ in per_rank] for per_rank in out]   # [rank][call][dest]
    cap = max(0, (64 << 10) // ((world - 1) * row_bytes) - 1)
    inline = min(8, cap)                  # first call: what max_tokens_per_rank could need
    for call in range(2):
        most = max(n for r in range(world) for d, n in enumerate(counts[r][call]) if d != r)
        for rank in range(world):
            disp, comb = out[rank][call][1], out[rank][call][2]
            hrows = -(-(16 + inline * meta_bytes) // row_bytes)
            (name, inl_send, inl_recv), *rest = disp
            if inline:
                assert name == "inline"
                assert inl_send == [0 if d == rank else (hrows + inline) * row_bytes
                                    for d in range(world)]
            else:
                assert (name, inl_send) == ("counts", [16] * world)
            assert len(rest) == (1 if most > inline else 0)
            [(_, back_send, back_recv)] = comb
            for d in range(world):
                n = counts[rank][call][d]
                if rest:
                    over = max(0, n - inline)
                    want = 0 if d == rank or not over else (-(-over * meta_bytes // row_bytes)
                                                           + over) * row_bytes
                    assert rest[0][1][d] == want, (rank, d, rest[0][1], want)
                assert back_recv[d] == (0 if d == rank else n * row_bytes)
                assert out[d][call][2][0][1][rank] == back_recv[d]
        inline = most if most <= cap else 0   # the next call's: this one's if it fit


def _mixed_k(rank, world):
    import ubep
    from ubep.testing import expert_fn, make_routing, make_tokens

    idx, w = make_routing(5, 2 + rank, 4 * world, kind="uniform", seed=21 + rank)
    x = make_tokens(rank, 5, 16, torch.bfloat16, seed=4)
    with ubep.Buffer(num_experts=4 * world, hidden=16, max_tokens_per_rank=8, max_top_k=4,
                     backend="torch") as buf:
        res = buf.dispatch(x, idx, w)
        y = buf.combine(expert_fn(res.recv_x), res.handle)
    return x, idx, w, res.recv_x, res.recv_src_rank, res.recv_src_token, res.recv_src_slot, y


def test_torch_backend_ranks_with_different_top_k():
    """Ranks may pass different K in one call (each <= max_top_k): the routing words keep
    max_top_k slots, so they line up on every receiver."""
    from ubep import reference
    from ubep.testing import expert_fn

    out = run_ranks(_mixed_k, 3)
    xs, idxs, ws = [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
    ref = reference.dispatch(xs, idxs, ws, 12)
    ref_y = reference.combine_partials([expert_fn(d.recv_x) for d in ref], ref, idxs, ws,
                                       bf16_ties_away=True)
    for r, o in enumerate(out):
        assert torch.equal(o[3].view(torch.int16), ref[r].recv_x.view(torch.int16))
        assert torch.equal(o[4], ref[r].recv_src_rank)
        assert torch.equal(o[5], ref[r].recv_src_token)
        assert torch.equal(o[6], ref[r].recv_src_slot)
        assert torch.equal(o[7].view(torch.int16), ref_y[r].view(torch.int16))


def _held_results(rank, world):
    """Results kept across later dispatches stay intact; dropped ones' memory is reused."""
    import ubep
    from ubep.testing import make_routing, make_tokens

    with ubep.Buffer(num_experts=8, hidden=32, max_tokens_per_rank=16, backend="torch") as buf:
        held, ptrs = [], []
        for call in range(6):
            idx, w = make_routing(16, 4, 8, kind="uniform", seed=call * 7 + rank)
            res = buf.dispatch(make_tokens(rank, 16, 32, torch.bfloat16, seed=call), idx, w)
            buf.combine(res.recv_x, res.handle)
            ptrs.append(res.recv_x.data_ptr())
            if call % 2 == 0:
                held.append((res.recv_x, res.recv_x.clone(), res.recv_x[1:]))
        intact = all(torch.equal(a, b) and torch.equal(v, b[1:]) for a, b, v in held)
        return intact, ptrs


def test_torch_backend_reuses_only_dropped_results():
    for intact, ptrs in run_ranks(_held_results, 2):
        assert intact
        held = set(ptrs[0::2])
        assert len(held) == 3 and not held & set(ptrs[1::2])   # never handed out twice
        assert len(set(ptrs[1::2])) < 3                          # dropped ones came back


def test_bf16_weight_split_matches_torch():
    """The compiled float32 -> bfloat16 rounding used for the combine weights' `hi, lo` split
    agrees with torch's, and `hi + lo` keeps ~16 significant bits of the weight."""
    import numpy as np
    import torch

    from ubep.runtime.torch_layout import _bf16_bits

    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal(2000), rng.random(2000) * 1e-3,
                        [0.0, -0.0, 1.0, -1.0, 0.5, 1 / 3]]).astype(np.float32)
    want = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    hi = np.array([_bf16_bits(b) for b in w.view(np.uint32)], dtype=np.uint16)
    assert np.array_equal(hi, want)
    hi_f = (hi.astype(np.uint32) << 16).view(np.float32)
    lo = np.array([_bf16_bits(b) for b in (w - hi_f).view(np.uint32)], dtype=np.uint16)
    lo_f = (lo.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(hi_f + lo_f - w) <= np.abs(w) * 2.0 ** -16)


@pytest.mark.parametrize("world,hidden", [(2, 48), (3, 48), (4, 48), (2, 1100)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_final_sums_match_embedding_bag(world, hidden, dtype):
    """The compiled source-side sum of each token's partials (CPU path) gives the same bits
    as `embedding_bag` over the partials laid out [received | own] (what the device path
    and the backend before it compute): tokens with 0..P partials, ties included, NaN/inf
    rows, own partials read from their own array; rows longer than the kernels' 512-element
    chunks, with a remainder."""
    import numpy as np
    import torch

    from ubep.runtime.torch_backend import _bag_sum
    from ubep.runtime.torch_layout import BAG_WORDS, final_sums_16, final_sums_f32

    dt = getattr(torch, dtype)
    rng = np.random.default_rng(world)
    tokens = 40
    per_token = [sorted(rng.choice(world, rng.integers(0, world + 1), replace=False))
                 for _ in range(tokens)]
    num_back = sum(len([r for r in ranks if r]) for ranks in per_token)
    num_own = sum(1 for ranks in per_token if 0 in ranks)
    # values on a coarse grid make exact ties between bf16 neighbours frequent
    grid = lambda n: torch.from_numpy(rng.integers(-300, 300, (n, hidden)) / 64).to(dt)  # noqa: E731
    back, own = grid(num_back), grid(num_own)
    back[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    rows, offsets, b, o = [], [], 0, 0
    for ranks in per_token:
        offsets.append(len(rows))
        for r in ranks:
            rows.append(num_back + o if r == 0 else b)
            o, b = o + (r == 0), b + (r != 0)
    rows, offsets = np.array(rows, dtype=np.int64), np.array(offsets, dtype=np.int64)
    want = _bag_sum(torch.cat([back, own]), torch.from_numpy(rows), torch.from_numpy(offsets))
    if dt != torch.float32:             # 16-bit partials as their bits (`BAG_WORDS`)
        word = BAG_WORDS[dt]
        got = final_sums_16(back.view(word).numpy(), own.view(word).numpy(), rows, offsets,
                            num_back, torch.empty((tokens, hidden), dtype=word).numpy())
        got = torch.from_numpy(got).view(dt)
    else:
        got = torch.from_numpy(final_sums_f32(back.numpy(), own.numpy(), rows, offsets,
                                              num_back, np.empty((tokens, hidden), np.float32)))
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()      # NaN stays NaN (its payload may not)
    assert torch.equal(got.masked_fill(nan, 0).view(torch.uint8),
                       want.masked_fill(nan, 0).view(torch.uint8))
    assert got.isinf().any() and not torch.equal(got, torch.zeros_like(got))


def _switch_over(rank, world, cases):
    """One Buffer through batch sizes on both sides of the inline capacity (tokens per peer
    that ride in dispatch's first collective) and of its scratch sizes, so calls alternate
    between one collective, a count exchange + rows, and rows inline + an overflow; the
    scratch buffers grow between calls (the CPU path's cached views must follow)."""
    import ubep
    from ubep.runtime import torch_backend

    torch_backend._INLINE_BYTES = 4 * 64 * 2 * (world - 1)   # 3 tokens of 64 bf16 per peer
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=24, backend="torch", max_top_k=4) as buf:
        return [run_case(buf, c, rank) for c in cases]


def _size_cases(world: int, sizes: list[int], *, wrap: int, seed: int,
                unweighted: int) -> list[Case]:
    """One case per size: rank r sends `(size + r) % wrap` tokens (hidden 64, top-4 of
    4 * world), bf16 and fp32 alternating, case i unweighted when `i % 3 == unweighted`."""
    return [Case(4 * world, 64, 4, tuple((s + r) % wrap for r in range(world)), "uniform",
                 ("bf16", "fp32")[i % 2], seed=seed + i, weighted=i % 3 != unweighted)
            for i, s in enumerate(sizes)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_backend_across_the_inline_switch_over(world):
    sizes = [1, 2, 3, 4, 1, 0, 24, 3, 2, 9, 1, 1, 17, 3]
    cases = _size_cases(world, sizes, wrap=25, seed=40, unweighted=2)
    per_rank = run_ranks(_switch_over, world, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(world)], contract="torch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("weighted", [True, False])
def test_bag_sums_match_the_oracle_sum(dtype, weighted):
    """The CPU combine's expert-side sums (compiled, two slots a pass, rows in chunks) give
    the bits of the oracle's loop for the slots of one rank: fp32 `acc + w * row` in slot
    order, one rounding by `.to(dtype)` (to nearest even); bags of 0..5 slots, a hidden
    size that is no multiple of the chunk, ties, NaN and inf."""
    import numpy as np
    import torch

    from ubep.runtime.torch_layout import BAG_WORDS, bag_sums

    dt = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    num_rows, hidden = 60, 1100
    rows = torch.from_numpy(rng.integers(-300, 300, (num_rows, hidden)) / 64).to(dt)
    rows[5, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    weights = torch.from_numpy(rng.random(num_rows).astype(np.float32))
    weights[7] = 0.5                                    # exact products: ties in the sums
    sizes = [0, 1, 2, 3, 4, 5, 2, 1, 5, 3, 0, 4]
    bag_rows = torch.from_numpy(rng.permutation(num_rows)[:sum(sizes)].astype(np.int64))
    bag_rows[:2] = torch.tensor([7, 5])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    want = []
    for j, n in enumerate(sizes):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for r in bag_rows[offsets[j]:offsets[j] + n].tolist():
            row = rows[r].to(torch.float32)
            acc = acc + (weights[r] * row if weighted else row)
        want.append(acc.to(dt))
    want = torch.stack(want)
    j0, j1 = 1, len(sizes) - 1                          # a range of bags, as combine asks
    if dt != torch.float32:             # 16-bit rows as their bits (`BAG_WORDS`)
        word = BAG_WORDS[dt]
        out = torch.empty((j1 - j0, hidden), dtype=word).numpy()
        bag_sums(rows.view(word).numpy(), weights.numpy(), weighted,
                 bag_rows.numpy(), offsets, j0, j1, out)
        got = torch.from_numpy(out).view(dt)
    else:
        out = np.empty((j1 - j0, hidden), dtype=np.float32)
        got = torch.from_numpy(bag_sums(rows.numpy(), weights.numpy(), weighted,
                                        bag_rows.numpy(), offsets, j0, j1, out))
    want = want[j0:j1]
    nan = want.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got.masked_fill(nan, 0).view(torch.uint8),
                       want.masked_fill(nan, 0).view(torch.uint8))
    assert got.isinf().any()


def _run_cases_subgroup(rank, world, cases, members):
    """`_run_cases` on a process group of `members` (global ranks), not the default one;
    the other ranks only join the group's creation (every rank must)."""
    import torch.distributed as dist

    import ubep

    group = dist.new_group(members)
    if rank not in members:
        return None
    outs = []
    for case in cases:
        with ubep.Buffer(group, num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend="torch") as buf:
            outs.append(run_case(buf, case, dist.get_rank(group)))
    return outs


def test_torch_backend_on_a_subgroup():
    """The collectives run on the group object the Buffer was given (group-local ranks), as
    `dist.all_to_all_single(group=...)` would run them: ranks 0 and 2 of 3 as a group of 2."""
    cases = _cases(2)[:3]
    members = [0, 2]
    per_rank = run_ranks(_run_cases_subgroup, 3, cases, members, timeout_s=180)
    assert per_rank[1] is None
    for i, case in enumerate(cases):
        check_case(case, [per_rank[m][i] for m in members], contract="torch")


def _run_cases_misaligned(rank, world, cases):
    """`_run_cases` with x at an odd element offset of its storage (rows off the 8-byte grid
    the CPU path reads whole rows by)."""
    import ubep
    from ubep.testing import expert_fn

    outs = []
    for case in cases:
        x, idx, w = case.inputs(rank)
        flat = torch.empty(x.numel() + 1, dtype=x.dtype)
        flat[1:] = x.reshape(-1)
        xm = flat[1:].view(x.shape)
        assert xm.data_ptr() % 8 and xm.is_contiguous()
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend="torch") as buf:
            res = buf.dispatch(xm, idx, w)
            y = buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted)
            outs.append({"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                         "tokens_per_expert": res.tokens_per_expert,
                         "recv_src_rank": res.recv_src_rank,
                         "recv_src_token": res.recv_src_token,
                         "recv_src_slot": res.recv_src_slot, "y": y})
    return outs


def test_torch_backend_misaligned_rows():
    """x viewed at an odd offset (2 bytes past an 8-byte boundary) dispatches as an aligned
    x does: the rows are copied onto the grid first, not read across it."""
    cases = [c for c in _cases(2) if c.dtype in ("bf16", "fp16")][:2]
    per_rank = run_ranks(_run_cases_misaligned, 2, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(2)], contract="torch")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=40), st.integers(0, 5))
def test_source_order_groups_rows_by_source(rows, extra):
    """`source_order` (the gathers' copy order) is a permutation of the indices that lists
    them by source, ascending, each source's in their original order."""
    import numpy as np

    from ubep.runtime.torch_layout import source_order

    rows = np.array(rows, np.int64)
    order = source_order(rows, int(rows.max(initial=-1)) + 1 + extra)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert order.tolist() == sorted(range(len(rows)), key=lambda i: (rows[i], i))
    if len(rows):
        with pytest.raises(IndexError, match="outside"):
            source_order(rows, int(rows.max()))
        with pytest.raises(IndexError, match="outside"):
            source_order(rows - int(rows.max()) - 1, 10)


def test_gather_rows_by_memcpy_and_its_bounds():
    """recv_x's gather (rows copied by memcpy): row i is `work[gather[i]]` for a received
    row, `x[own_tokens[...]]` for an own one, byte for byte; an index past either array
    raises instead of copying out of bounds."""
    import numpy as np

    from ubep.runtime.torch_layout import gather_rows

    rng = np.random.default_rng(5)
    rw, num_remote, num_own = 37, 6, 4            # an odd row of uint64 words
    work = rng.integers(0, 2**63, (num_remote, rw), dtype=np.int64).view(np.uint64)
    x = rng.integers(0, 2**63, (num_own, rw), dtype=np.int64).view(np.uint64)
    own_tokens = np.array([3, 0, 2, 1], np.int64)
    gather = np.array([5, 0, 7, 0, 9, 2, 6], np.int64)  # >= num_remote: own row (via own_tokens)
    out = np.zeros(len(gather) * rw, np.uint64)
    gather_rows(work.reshape(-1), x.reshape(-1), gather, num_remote, own_tokens, out, rw)
    want = np.stack([work[g] if g < num_remote else x[own_tokens[g - num_remote]]
                     for g in gather])
    assert np.array_equal(out.reshape(-1, rw), want)
    with pytest.raises(IndexError, match="out of its arrays' bounds"):
        gather_rows(work.reshape(-1), x.reshape(-1), np.array([num_remote]), num_remote,
                    np.array([num_own], np.int64), out, rw)
    with pytest.raises(IndexError, match="out of its arrays' bounds"):
        gather_rows(work.reshape(-1), x.reshape(-1), gather, num_remote, own_tokens,
                    out[:-1], rw)


def _late_all_to_all(rank, world, delay_s):
    """Rank 1 enters the collective `delay_s` late (past `POLL_S`); every rank returns what
    it received."""
    import time

    import torch.distributed as dist

    from ubep.runtime.torch_backend import POLL_S, all_to_all

    assert delay_s > 5 * POLL_S
    if rank == 1:
        time.sleep(delay_s)
    inp = torch.arange(4 * world, dtype=torch.int64) + 100 * rank
    out = torch.empty_like(inp)
    all_to_all(dist.group.WORLD, out, inp, [4] * world, [4] * world)
    return out.tolist()


def test_gloo_wait_outlasts_its_poll():
    """A synchronous collective whose peer arrives after the poll window (`POLL_S`) still
    returns the peer's bytes: the wait falls back to blocking, it does not give up."""
    got = run_ranks(_late_all_to_all, 2, 0.05, timeout_s=60)
    for r in range(2):
        assert got[r] == [100 * s + 4 * r + i for s in range(2) for i in range(4)]


class _Work:
    """A collective's `Work` that completes on its `n`-th `is_completed` poll."""

    def __init__(self, n: int):
        self.n, self.polls, self.waits = n, 0, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls >= self.n

    def wait(self) -> bool:
        self.waits += 1
        return True


class _Group:
    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name


def test_wait_polls_only_host_collectives(monkeypatch):
    """gloo: polled until complete, then `wait()` (which raises a failed collective's error
    and keeps the group's timeout); a device backend (NCCL): `wait()` alone, whose host side
    does not block, so polling it would only synchronise the host with the device. (The
    poll window is widened: on a loaded host two yields can outlast the real one.)"""
    from ubep.runtime import collectives
    from ubep.runtime.torch_backend import wait

    monkeypatch.setattr(collectives, "POLL_S", 10.0)

    w = _Work(3)
    wait(w, _Group("gloo"))
    assert (w.polls, w.waits) == (3, 1)
    w = _Work(3)
    wait(w, _Group("nccl"))
    assert (w.polls, w.waits) == (0, 1)


def _completes_without_wait(rank, world):
    """Whether an async all_to_all_single's Work reports completion before `wait()` is
    called (polled up to 20 s)."""
    import os
    import time

    import torch.distributed as dist

    work = dist.all_to_all_single(torch.empty(4 * world), torch.ones(4 * world), async_op=True)
    end = time.monotonic() + 20
    while not work.is_completed() and time.monotonic() < end:
        os.sched_yield()
    done = work.is_completed()
    work.wait()
    return done


def test_gloo_all_to_all_completes_without_wait():
    """`torch_backend.wait` polls `is_completed()` before blocking: that only pays if gloo
    completes an all-to-all on its own threads, as it does (a reduce-scatter it completes
    inside `wait()`); a torch that changed this would make every poll spin its window."""
    assert run_ranks(_completes_without_wait, 2, timeout_s=60) == [True, True]


def _interleaved_handles(rank, world, cases):
    """Every case dispatched first (same shapes and different ones: the kernels' workspace
    and scratch are reused), then all combined in reverse order: a handle must keep its
    own plan however many dispatches ran after it."""
    import ubep
    from ubep.testing import expert_fn

    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=16, max_top_k=4, backend="torch") as buf:
        results = []
        for case in cases:
            x, idx, w = case.inputs(rank)
            results.append(buf.dispatch(x, idx, w))
        ys = [buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted)
              for case, res in reversed(list(zip(cases, results)))][::-1]
        return [{"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                 "tokens_per_expert": res.tokens_per_expert,
                 "recv_src_rank": res.recv_src_rank, "recv_src_token": res.recv_src_token,
                 "recv_src_slot": res.recv_src_slot, "y": y}
                for res, y in zip(results, ys)]


@pytest.mark.parametrize("world", [2, 3])
def test_torch_backend_handles_combined_after_later_dispatches(world):
    sizes = [1, 1, 3, 1, 16, 2, 0, 1]
    cases = _size_cases(world, sizes, wrap=17, seed=70, unweighted=1)
    per_rank = run_ranks(_interleaved_handles, world, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(world)], contract="torch")


def test_cpu_kernels_check_their_sizes():
    """The CPU path's kernels take addresses and sizes: a size too small for what the plan
    writes or reads raises IndexError instead of touching memory past it."""
    import numpy as np

    from ubep.runtime import torch_layout as tl

    world, per_rank, me, T, K, row_bytes = 2, 2, 0, 3, 2, 32
    idx = np.array([[0, 2], [3, 1], [2, 3]], np.int64)
    w = np.full((T, K), 0.5, np.float32)
    x = np.arange(T * row_bytes, dtype=np.uint8)
    ws = np.zeros(tl.ws_size(world, T, K, K), np.int64)
    send = np.zeros(64 * row_bytes, np.uint8)
    hrows = 2
    args = (idx.ctypes.data, w.ctypes.data, T, K, x.ctypes.data, x.nbytes, send.ctypes.data)
    tail = (row_bytes, per_rank, world, me, K, 4, hrows, ws.ctypes.data)
    num_back, sends, first, n_me = tl.pack_send_at(*args, send.nbytes, *tail, len(ws))
    assert (num_back, sends, first, n_me) == (3, 5, 0, 2)
    with pytest.raises(IndexError):             # the rows to the peer do not fit
        tl.pack_send_at(*args, (hrows + 1) * row_bytes, *tail, len(ws))
    with pytest.raises(IndexError):             # the workspace is too small for the plan
        tl.pack_send_at(*args, send.nbytes, *tail, len(ws) - 1)
    with pytest.raises(IndexError):             # x shorter than the tokens it names
        tl.pack_send_at(*args[:5], x.nbytes - 1, *args[6:], send.nbytes, *tail, len(ws))
    rows = np.ones((4, 8), np.float32)
    plan = np.array([0, 3, 1, 2, 0, 2], np.int64)   # bag rows [0, 3, 1, 2], offsets [0, 2]
    out = np.zeros((2, 8), np.float32)
    halves = np.array([0.5, 1.0, 2.0, 0.25], np.float32)
    tl.bag_sums_at(tl.KIND_F32, rows.ctypes.data, 4, 8, halves.ctypes.data, True,
                   plan.ctypes.data, plan.ctypes.data + 32, 4, 2, 0, 2, out.ctypes.data)
    assert out[0].tolist() == [0.75] * 8 and out[1].tolist() == [3.0] * 8
    with pytest.raises(IndexError):             # bag row 3 past expert_out's 3 rows
        tl.bag_sums_at(tl.KIND_F32, rows.ctypes.data, 3, 8, halves.ctypes.data, True,
                       plan.ctypes.data, plan.ctypes.data + 32, 4, 2, 0, 2, out.ctypes.data)
    y = np.zeros((2, 8), np.float32)
    fin = np.array([0, 1, 0, 2], np.int64)      # final rows [0, 1], offsets [0, 2]
    tl.final_sums_at(tl.KIND_F32, rows.ctypes.data, 1, rows.ctypes.data, 1, 8, fin.ctypes.data,
                     fin.ctypes.data + 16, 2, 2, y.ctypes.data)
    assert y[0].tolist() == [2.0] * 8 and y[1].tolist() == [0.0] * 8
    with pytest.raises(IndexError):             # row 1 past a work buffer of one row
        tl.final_sums_at(tl.KIND_F32, rows.ctypes.data, 1, rows.ctypes.data, 0, 8,
                         fin.ctypes.data, fin.ctypes.data + 16, 2, 2, y.ctypes.data)
