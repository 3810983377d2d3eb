import pytest
import torch

import ubep


def test_layout_counts():
    idx = torch.tensor([[0, 1], [1, 3], [-1, -1], [2, -1]])
    tokens_per_rank, tokens_per_expert, is_token_in_rank = ubep.get_dispatch_layout(idx, 4, 2)
    assert tokens_per_rank.tolist() == [2, 2]          # token 0 twice on rank 0 counts once
    assert tokens_per_expert.tolist() == [1, 2, 1, 1]
    assert is_token_in_rank.tolist() == [[True, False], [True, True], [False, False],
                                         [False, True]]
    layout = ubep.get_dispatch_layout(idx.to(torch.int32), 4, 4)
    assert layout.tokens_per_rank.tolist() == [1, 2, 1, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=5, num_ranks=2), "divisible"),
    (dict(num_experts=4, num_ranks=0), "num_ranks"),
])
def test_layout_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ubep.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), **kwargs)


def test_layout_rejects_out_of_range():
    with pytest.raises(ValueError, match="expert id 4"):
        ubep.get_dispatch_layout(torch.tensor([[4]]), 4, 2)
