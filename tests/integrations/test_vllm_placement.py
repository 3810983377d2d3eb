"""vLLM expert maps -> ubep ids (pure torch; runs without vLLM)."""

import pytest
import torch

from ubep.integrations.vllm.placement import local_to_global, ubep_ids_of_global


def _maps(owner_of: list[int], world: int) -> torch.Tensor:
    """Expert maps where global expert g lives on rank owner_of[g], slots in id order."""
    maps = torch.full((world, len(owner_of)), -1, dtype=torch.int32)
    for r in range(world):
        held = [g for g, o in enumerate(owner_of) if o == r]
        maps[r, held] = torch.arange(len(held), dtype=torch.int32)
    return maps


def test_linear_placement_is_the_identity():
    maps = _maps([0, 0, 0, 0, 1, 1, 1, 1], 2)
    assert torch.equal(ubep_ids_of_global(maps), torch.arange(8))


def test_round_robin_placement_sends_each_expert_to_its_holder():
    maps = _maps([0, 1, 0, 1, 0, 1, 0, 1], 2)
    ids = ubep_ids_of_global(maps)
    assert ids.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # a ubep id names the holder (id // L) and the holder's slot (id % L)
    for g, u in enumerate(ids.tolist()):
        assert maps[u // 4, g] == u % 4


def test_an_eplb_like_permutation_round_trips():
    torch.manual_seed(0)
    owner = torch.randperm(12) % 3                       # 4 experts on each of 3 ranks
    maps = _maps(owner.tolist(), 3)
    ids = ubep_ids_of_global(maps)
    assert sorted(ids.tolist()) == list(range(12))
    for r in range(3):
        back = local_to_global(maps[r])
        assert torch.equal(ids[back], torch.arange(4) + 4 * r)


@pytest.mark.parametrize("owner, world, match", [
    ([0, 0, 1, -1], 2, "global expert 3 is held by 0 ranks"),
    ([0, 0, 0, 1], 2, "every rank must hold slots 0..2"),
])
def test_placements_ubep_cannot_serve_are_refused(owner, world, match):
    maps = _maps([o if o >= 0 else 99 for o in owner], world)
    with pytest.raises(ValueError, match=match):
        ubep_ids_of_global(maps)


def test_an_expert_held_twice_is_refused():
    maps = _maps([0, 0, 1, 1], 2)
    maps[1, 0] = 2
    with pytest.raises(ValueError, match="global expert 0 is held by 2 ranks"):
        ubep_ids_of_global(maps)
