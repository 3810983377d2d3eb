"""Every sync variant delivers whole blocks of the right epoch under the models it claims,
and the checker finds the bug in each weakened or broken variant."""

import pytest

from ubep.verify import MODELS, check, check_all, variants
from ubep.verify.protocols import dc, direct, sp, sw, tff

RUNTIME_VARIANTS = ("sw", "tff", "dc", "sp", "direct")


@pytest.mark.parametrize("repeat", [False, True], ids=["distinct", "repeat"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("make", [sw, tff, dc, sp, direct], ids=RUNTIME_VARIANTS)
@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (2, 3)], ids=["2b2e", "3b2e", "2b3e"])
def test_runtime_variants_are_correct_everywhere(make, model, repeat, shape):
    blocks, epochs = shape
    result = check(make(blocks, epochs, repeat), model)
    assert result.ok, result.counterexamples
    assert result.outcomes, "no execution finished"
    assert result.states > 10


def test_every_claim_holds_exactly():
    """ok under a claimed model for both kinds of data; violated under every other one."""
    rows = check_all()
    assert {p.name for p, _, _ in rows} >= set(RUNTIME_VARIANTS)
    for proto, model, results in rows:
        ok = all(r.ok for r in results)
        assert ok == (model in proto.claimed_models), (proto.name, model, results)


@pytest.mark.parametrize("model", MODELS)
def test_flag_before_payload_is_found_on_every_model(model):
    for proto in (sw(flag_first=True), tff(flag_first=True), sp(marker_first=True)):
        result = check(proto, model)
        assert "torn" in result.counterexamples, (proto.name, model)
        trace = result.counterexamples["torn"]
        assert trace[-1].startswith("R deliver")


def test_tff_without_release_is_torn_only_on_the_weak_model():
    proto = tff(release=False)
    assert check(proto, "sc").ok and check(proto, "tso").ok
    assert check(proto, "block").ok          # the flag rides inside the atomic block
    weak = check(proto, "weak")
    assert set(weak.counterexamples) == {"torn"}
    # the counterexample drains the flag before the payload
    steps = weak.counterexamples["torn"]
    assert steps.index("S drain b0.1") < len(steps) - 1
    assert "S drain b0.0" not in steps


@pytest.mark.parametrize("make", [tff, sp], ids=["tff", "sp"])
def test_plain_polling_loads_are_torn_only_on_the_weak_model(make):
    # the acquire half of release/acquire: without it the payload load runs ahead of the
    # flag/marker load on a weakly ordered CPU
    proto = make(acquire=False)
    for model in ("sc", "tso", "block"):
        assert check(proto, model).ok, model
    weak = check(proto, "weak")
    assert set(weak.counterexamples) == {"torn"}
    assert any("(early, before instruction" in step for step in weak.counterexamples["torn"])


def test_tff_without_release_delivers_right_on_tso():
    assert check(tff(release=False, blocks=3, epochs=3), "tso").ok


def test_dc_without_release_is_stale_with_repeated_data():
    # equal bytes in two epochs: the markers match the new checksum while the old data is
    # still there; only ordering (the release of the checksum word) prevents it
    assert "stale" in check(dc(release=False, repeat=True), "weak").counterexamples
    assert "stale" in check(dc(release=False, repeat=True), "block").counterexamples
    assert check(dc(release=False, repeat=True), "tso").ok


def test_sw_without_release_needs_tso():
    assert check(sw(release=False), "tso").ok
    assert not check(sw(release=False), "weak").ok


def test_sp_needs_the_rearm_and_a_released_ack():
    assert "stale" in check(sp(rearm=False), "sc").counterexamples
    assert check(sp(ack_release=False), "tso").ok
    assert set(check(sp(ack_release=False), "weak").counterexamples) == {"stuck"}


@pytest.mark.parametrize("model", MODELS)
def test_sentinel_in_payload_hangs_the_receiver(model):
    # why the runtime checks rows for the sentinel before sending under sp
    result = check(sp(sentinel_in_data=True), model)
    assert set(result.counterexamples) == {"stuck"}


def test_variant_names_are_unique_and_described():
    names = [p.name for p in variants()]
    assert len(names) == len(set(names))
    assert all(p.description for p in variants())
    broken = [p for p in variants() if not p.claimed_models]
    assert all(p.description.startswith("BROKEN") for p in broken)


def test_command_prints_the_matrix_and_a_trace(capsys):
    from ubep.verify.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "tff_plain" in out and "torn" in out
    assert main(["--trace", "tff_plain", "weak"]) == 0
    out = capsys.readouterr().out
    assert "torn" in out and "R deliver block 0 of epoch 1" in out


def test_ubep_verify_subcommand(capsys):
    from ubep.cli import main

    assert main(["verify", "--sync-info"]) == 0
    assert "all variants correct" in capsys.readouterr().out
    assert main(["verify", "--trace", "nope", "weak"]) == 2
    assert "VARIANT must be one of" in capsys.readouterr().out
    assert main(["verify", "--blocks", "0"]) == 2
