"""ubep.testing.run_hosts: ranks on emulated hosts (network + mount namespaces on this machine).

Each test checks one guarantee of the harness that the multi-host tests build on: collectives
cross the link, /dev/shm is private to a host, `auto` sees several shared-memory domains,
uneven hosts through a bridge, a SIGKILLed rank, the rate limit, the leak report, and no
namespace left behind. Needs root and `ip`: skipped elsewhere with the reason.
"""

import functools
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from ubep import reference
from ubep.emulated_hosts import NS_PREFIX, ShmLeakError, sweep_stale
from ubep.testing import (
    Case,
    RankFailure,
    check_case,
    hosts_available,
    run_case,
    run_hosts,
)

#: what `Buffer(backend="auto")` picks on a group over two emulated hosts, and a phrase of its
#: reason
AUTO_ACROSS_HOSTS = ("hybrid", "shared-memory domains")


def _our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"{NS_PREFIX}{os.getpid()}-")]


@pytest.fixture
def hosts():
    """Skip where emulated hosts cannot be made; after the test, none of ours is left."""
    ok, why = hosts_available()
    if not ok:
        pytest.skip(why)
    yield
    assert _our_namespaces() == []


# -- functions the ranks run ------------------------------------------------------------------

def _collectives(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    send = torch.tensor([rank * 100 + dst for dst in range(world)], dtype=torch.int64)
    recv = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv, send)
    return {"sum": float(t), "recv": recv.tolist(), "host": int(os.environ["GROUP_RANK"]),
            "local": int(os.environ["LOCAL_RANK"])}


def _shm_view(rank, world, name):
    from ubep.runtime.shm.segments import host_memory_key

    path = f"/dev/shm/{name}"
    if rank == 0:
        with open(path, "w") as f:
            f.write("host 0")
    dist.barrier()
    seen = os.path.exists(path)
    dist.barrier()
    if rank == 0:
        os.unlink(path)
    return {"seen": seen, "key": host_memory_key()}


def _auto_buffer(rank, world):
    import ubep

    case = Case(num_experts=8, hidden=16, top_k=3, tokens=(5, 0, 7, 3), routing="skewed",
                dtype="bf16", seed=3)
    with ubep.Buffer(num_experts=8, hidden=16, max_tokens_per_rank=16, timeout_s=60) as buf:
        return {"backend": buf.config.backend, "reason": buf.config.backend_reason,
                "out": run_case(buf, case, rank), "case": case}


def _lose_rank(rank, world, victim):
    # after a barrier: every pair of the group is connected (a rank killed while its peers
    # still build gloo's mesh can leave one of them waiting for a pair until its timeout)
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _net_bytes():
    stats = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics"
    with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
        return int(rx.read()), int(tx.read())


def _fan_in(rank, world, nbytes):
    """Every other rank sends rank 0 its share of `nbytes` at once; rank 0 times the whole."""
    share = nbytes // (world - 1)
    dist.barrier()
    before, start = _net_bytes(), time.perf_counter()
    if rank == 0:
        bufs = [torch.empty(share, dtype=torch.uint8) for _ in range(1, world)]
        for w in [dist.irecv(b, src) for src, b in enumerate(bufs, 1)]:
            w.wait()
    else:
        dist.send(torch.full((share,), rank, dtype=torch.uint8), 0)
    took = time.perf_counter() - start
    dist.barrier()      # a sender's last bytes may still wait in its qdisc when send returns
    after = _net_bytes()
    return {"s": took, "rx": after[0] - before[0], "tx": after[1] - before[1]}


def _leave_shm_file(rank, world):
    if rank == 2:
        with open(f"/dev/shm/ubep_left_by_rank{rank}", "w") as f:
            f.write("leak")
    return rank


# -- tests --------------------------------------------------------------------------------------

def test_collectives_cross_two_hosts(hosts):
    out = run_hosts(_collectives, hosts=2, ranks_per_host=2)
    assert out.hosts == ((0, 1), (2, 3)) and out.leaks == {}
    for rank, r in enumerate(out):
        assert r["sum"] == 10.0
        assert r["recv"] == [src * 100 + rank for src in range(4)]
        assert (r["host"], r["local"]) == divmod(rank, 2)


def test_each_host_has_its_own_dev_shm(hosts):
    name = f"ubep_emu_probe_{os.getpid()}"
    out = run_hosts(_shm_view, name)
    assert [r["seen"] for r in out] == [True, True, False, False]
    keys = [r["key"] for r in out]
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
    assert not os.path.exists(f"/dev/shm/{name}")


def test_auto_sees_two_shared_memory_domains(hosts):
    out = run_hosts(_auto_buffer)
    backend, phrase = AUTO_ACROSS_HOSTS
    for r in out:
        assert r["backend"] == backend and phrase in r["reason"], r["reason"]
    # hybrid's first call sums per host first (docs/multihost.md, "Rounding contract")
    check_case(out[0]["case"], [r["out"] for r in out],
               contract=functools.partial(reference.combine_partials,
                                          group_of_rank=[0, 0, 1, 1]))


def test_three_uneven_hosts_through_a_bridge(hosts):
    out = run_hosts(_collectives, ranks_per_host=(1, 2, 1))
    assert out.hosts == ((0,), (1, 2), (3,)) and out.leaks == {}
    assert [r["host"] for r in out] == [0, 1, 1, 2]
    for rank, r in enumerate(out):
        assert r["sum"] == 10.0 and r["recv"] == [src * 100 + rank for src in range(4)]
    keys = [r["key"] for r in run_hosts(_shm_view, f"ubep_emu_probe_{os.getpid()}",
                                        ranks_per_host=(1, 2, 1))]
    assert keys[1] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3


def test_a_sigkilled_rank_is_reported_and_the_others_finish(hosts):
    # rank 0 is the one whose loss would take a rank-held store with it
    out = run_hosts(_lose_rank, 0, return_exceptions=True, timeout_s=60)
    assert isinstance(out[0], RankFailure) and out[0].kind == "died"
    assert "SIGKILL" in out[0].message
    assert list(out[1:]) == [1, 2, 3] and out.leaks == {}


@pytest.mark.parametrize("ranks_per_host", [(1, 1), (1, 1, 1)], ids=["veth", "bridge"])
def test_link_rate_limits_each_host_link(hosts, ranks_per_host):
    # 20 MB at 100 Mbit/s takes >= 1.6 s whatever the load; with a bridge two hosts send to
    # host 0 at once, so it holds only if the link into host 0 is limited too
    nbytes = 20_000_000
    out = run_hosts(_fan_in, nbytes, ranks_per_host=ranks_per_host, link_rate="100mbit")
    assert out[0]["rx"] >= nbytes                 # the rows crossed host 0's link
    assert all(r["tx"] >= nbytes // (len(out) - 1) for r in out[1:])
    assert out[0]["s"] >= 1.0, f"{nbytes} B in {out[0]['s']:.2f} s through a 100mbit link"


def test_a_file_left_in_a_hosts_dev_shm_is_reported(hosts):
    out = run_hosts(_leave_shm_file)
    assert list(out) == [0, 1, 2, 3]
    assert out.leaks == {1: ["ubep_left_by_rank2"]}
    with pytest.raises(ShmLeakError, match="emulated host 1 left"):
        run_hosts(_leave_shm_file, check_leaks=True)
    assert not os.path.exists("/dev/shm/ubep_left_by_rank2")


def test_namespaces_of_a_dead_run_are_swept(hosts):
    gone = subprocess.Popen(["true"])
    gone.wait()
    ns = f"{NS_PREFIX}{gone.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert ns in sweep_stale()
        assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                        text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("kw, rule", [
    ({"hosts": 3, "ranks_per_host": (1, 2)}, "one count per host"),
    ({"ranks_per_host": (1, 0)}, "int >= 1"),
    ({"hosts": 0}, "between 1 and"),
    ({"link_rate": "fast"}, "tc rate"),
])
def test_bad_arguments_name_the_rule(kw, rule):
    with pytest.raises(ValueError, match=rule):
        run_hosts(_collectives, **kw)
