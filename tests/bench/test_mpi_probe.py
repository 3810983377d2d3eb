"""The MPI probe and the `mpi` fixture: retried, then a failure, never a silent skip, where
MPI is installed; a skip with its reason only where it is not. `mpiexec` is replaced by a
stand-in that fails as a loaded host's does (a timeout), so this runs with or without MPI."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from ubep.bench import run as bench_run


class _Mpiexec:
    """`subprocess.run` for the probe: times out `fails` times, then exits 0."""

    def __init__(self, fails: int):
        self.fails, self.calls = fails, 0

    def run(self, args, **kw):
        self.calls += 1
        assert "mpiexec" in args[0] and kw["timeout"] == bench_run.MPI_PROBE_TIMEOUT_S
        if self.calls <= self.fails:
            raise subprocess.TimeoutExpired(args, kw["timeout"])
        return subprocess.CompletedProcess(args, 0, "", "")


@pytest.fixture
def probe(monkeypatch):
    """MPI installed (as far as `mpi_missing_reason` can tell), `mpiexec` the stand-in."""
    def use(fails: int) -> _Mpiexec:
        fake = _Mpiexec(fails)
        monkeypatch.setattr(bench_run, "mpi_missing_reason", lambda: None)
        monkeypatch.setattr(bench_run, "subprocess", SimpleNamespace(
            run=fake.run, TimeoutExpired=subprocess.TimeoutExpired,
            CompletedProcess=subprocess.CompletedProcess, DEVNULL=subprocess.DEVNULL))
        monkeypatch.setattr(bench_run, "MPI_PROBE_PAUSE_S", 0.0)
        return fake

    bench_run.mpi_unavailable_reason.cache_clear()
    yield use
    bench_run.mpi_unavailable_reason.cache_clear()    # the real probe next time


def test_a_slow_mpiexec_is_probed_again(probe):
    """Mutation: one probe (`MPI_PROBES = 1`), its timeout taken as "MPI unavailable". A
    probe that times out twice and then starts finds MPI available, on its third try."""
    fake = probe(2)
    assert bench_run.MPI_PROBES >= 3
    assert bench_run.mpi_unavailable_reason() is None
    assert fake.calls == 3


def test_an_installed_mpi_that_never_starts_fails_the_test(probe, request):
    """Mutation: the `mpi` fixture skips when the probe fails (CI stays green with MPI
    broken). Every probe times out: `MPI_PROBES` tries, then the fixture fails; a skip here
    would fail this test, not skip it."""
    fake = probe(bench_run.MPI_PROBES)
    with pytest.raises(BaseException) as outcome:      # fail and skip are BaseExceptions
        request.getfixturevalue("mpi")
    assert outcome.type is pytest.fail.Exception, outcome
    assert outcome.match(r"MPI is installed but cannot run: `mpiexec -n 2` does not run "
                         rf"here.*\({bench_run.MPI_PROBES} tries\)")
    assert fake.calls == bench_run.MPI_PROBES


def test_mpi_not_installed_skips_with_its_reason(monkeypatch, request):
    """Only an absent MPI (mpi4py or mpiexec missing) is a skip, with the reason."""
    monkeypatch.setattr(bench_run, "mpi_missing_reason",
                        lambda: "no mpiexec at /x (pip install mpich)")
    with pytest.raises(pytest.skip.Exception, match="no mpiexec at /x"):
        request.getfixturevalue("mpi")
