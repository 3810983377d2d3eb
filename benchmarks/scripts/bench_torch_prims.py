"""The same bytes through three primitives: is gloo's all_to_all a competent baseline here?

Not a test (pytest does not collect it). Two ranks, each bound to its own core as `ubep
bench` binds them (gloo's threads left free); one exchange of N bytes each way between the
two, each started after a tight cross-process barrier, interleaved round by round:

* `wrapper`: `dist.all_to_all_single` (what the raw-collectives line called before);
* `direct`: the same collective called on the process group object
  (`ubep.runtime.torch_backend.all_to_all`: what the backend and the raw line call);
* `socket`: a bare TCP exchange of the same bytes on a loopback socket between the two
  ranks (non-blocking send/recv under `select`, no threads): the floor a transport that
  runs on the caller's thread could reach on this host.

    .venv/bin/python -m benchmarks bench_torch_prims [sizes] [rounds]
"""

from __future__ import annotations

import gc
import os
import select
import socket
import sys
import time

import numpy as np

KINDS = ("wrapper", "direct", "socket")


def _exchange(sock: socket.socket, send: np.ndarray, recv: np.ndarray) -> None:
    ms, mr = memoryview(send), memoryview(recv)
    so = ro = 0
    while so < len(send) or ro < len(recv):
        r, w, _ = select.select([sock] if ro < len(recv) else [],
                                [sock] if so < len(send) else [], [])
        if w:
            try:
                so += sock.send(ms[so:])
            except BlockingIOError:
                pass
        if r:
            try:
                ro += sock.recv_into(mr[ro:])
            except BlockingIOError:
                pass


def _rank(rank: int, world: int, sizes: list[int], rounds: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from ubep.bench.flags import HostSync
    from ubep.bench.runner import pin_rank
    from ubep.runtime.torch_backend import all_to_all

    torch.set_num_threads(1)
    pin_rank(rank, world)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    if rank == 0:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", port))
        ls.listen(1)
        sync.barrier()
        sock, _ = ls.accept()
        ls.close()
    else:
        sync.barrier()
        sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    pg = dist.group.WORLD
    out: dict = {}
    try:
        for size in sizes:
            send = torch.ones(size, dtype=torch.uint8)
            recv = torch.empty(size, dtype=torch.uint8)
            split = [0, size] if rank == 0 else [size, 0]
            res = {k: [] for k in KINDS}
            gc.disable()
            for it in range(rounds + 10):
                for k in KINDS:
                    sync.barrier()
                    t0 = time.perf_counter_ns()
                    if k == "wrapper":
                        dist.all_to_all_single(recv, send, split, split)
                    elif k == "direct":
                        all_to_all(pg, recv, send, split, split)
                    else:
                        _exchange(sock, send.numpy(), recv.numpy())
                    if it >= 10:
                        res[k].append((time.perf_counter_ns() - t0) / 1e3)
            gc.enable()
            out[size] = {k: np.array(v) for k, v in res.items()}
    finally:
        sock.close()
        sync.close()
    return out


def main() -> None:
    from ubep.testing import run_ranks

    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "16,28672,1849344").split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    res = run_ranks(_rank, 2, sizes, rounds, 20000 + os.getpid() % 20000, timeout_s=900)
    print(f"P=2, {rounds} rounds interleaved; load {os.getloadavg()[0]:.1f}; µs per exchange "
          f"(max over ranks): median p10 p90")
    for size in sizes:
        print(f"{size} B each way")
        for k in KINDS:
            t = np.maximum(res[0][size][k], res[1][size][k])
            print(f"   {k:8s} {np.median(t):9.1f} {np.percentile(t, 10):9.1f} "
                  f"{np.percentile(t, 90):9.1f}")


if __name__ == "__main__":
    main()
