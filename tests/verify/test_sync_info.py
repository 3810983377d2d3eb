"""`ubep.sync_info()` states the guarantee each variant relies on, per CPU architecture."""

import dataclasses
import platform

import pytest

from ubep import SyncInfo, sync_info


def test_this_machine_is_reported_and_checked():
    info = sync_info(check=True)
    assert isinstance(info, SyncInfo)
    assert info.machine == platform.machine()
    assert info.verified is True
    assert [v.variant for v in info.variants] == ["sw", "tff", "dc", "sp"]
    text = str(info)
    assert info.machine in text and "512 B" in text and "all variants correct" in text


def test_x86_relies_on_tso_and_a_release_flag():
    info = sync_info("x86_64")
    assert info.memory_model == "x86-TSO" and info.verify_model == "tso"
    assert "release" in info.flag_store and "acquire" in info.flag_load
    assert "memcpy" in info.payload_copy
    assert "TSO" in info.variant("tff").relies_on
    assert info.variant("sw").granularity == "batch"
    assert info.variant("tff").granularity == "block"


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64"])
def test_other_cpus_rely_on_release_acquire(machine):
    info = sync_info(machine, check=True)
    assert info.verify_model == "weak"
    assert "release/acquire" in info.variant("sp").relies_on
    assert info.verified is True          # the four variants hold under the weak model


def test_paper_assumption_is_stated():
    info = sync_info("aarch64")
    assert info.paper_atomic_block_bytes == 512
    assert "480 B payload" in info.paper
    assert info.atomic_store_bytes == 8


def test_unchecked_by_default_and_frozen():
    info = sync_info()
    assert info.verified is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.machine = "other"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="machine=''"):
        sync_info("")
    with pytest.raises(ValueError, match="variant='xx'"):
        sync_info().variant("xx")
