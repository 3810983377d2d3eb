"""The benchmark tests' `mpi` fixture: MPI runs here, or the test is skipped for a stated
reason (not installed) or fails (installed but `mpiexec` does not start)."""

from __future__ import annotations

import pytest

from ubep.bench import run as bench_run


@pytest.fixture
def mpi() -> None:
    """Skip only if mpi4py or MPICH's `mpiexec` is absent (`mpi_missing_reason`); where both
    are installed (the `dev` extra installs them) a probe that still fails after its retries
    (`mpi_unavailable_reason`) fails the test: a broken MPI is not a reason to go green."""
    missing = bench_run.mpi_missing_reason()
    if missing is not None:
        pytest.skip(missing)
    why = bench_run.mpi_unavailable_reason()
    if why is not None:
        pytest.fail(f"MPI is installed but cannot run: {why}", pytrace=False)
