"""Persistent worker threads of one rank: worker 0 is the caller, 1..n-1 are threads.

Threads are started once per Buffer and released per call with the call's task; they stop
on a `None` sentinel. They hold nothing but their queues, so a forgotten backend can still be
collected (its finalizer stops them). Kernels release the GIL (`nogil=True`), so workers run
in parallel while they move data.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


def _worker_main(tasks: queue.SimpleQueue, done: queue.SimpleQueue, j: int) -> None:
    while True:
        fn = tasks.get()
        if fn is None:
            return
        try:
            fn(j)
            done.put((j, None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            done.put((j, e))
        del fn


class WorkerPool:
    """`n - 1` threads that run a task alongside the calling thread."""

    def __init__(self, n: int, name: str = "ubep-worker"):
        self.n = n
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._tasks = [queue.SimpleQueue() for _ in range(n - 1)]
        self._threads = [
            threading.Thread(target=_worker_main, args=(self._tasks[j - 1], self._done, j),
                             name=f"{name}-{j}", daemon=True)
            for j in range(1, n)]
        for t in self._threads:
            t.start()
        self._closed = False

    def run(self, fn: Callable[[int], None], n: int,
            on_error: Callable[[BaseException], None]) -> None:
        """Run `fn(j)` for j in [0, n): j = 0 here, the rest on threads; wait for all.

        The first exception is re-raised after every worker returned; `on_error` is called as
        soon as one fails, so the others can stop waiting.
        """
        if n > self.n:
            raise ValueError(f"n={n} exceeds the pool's {self.n} workers")
        for j in range(1, n):
            self._tasks[j - 1].put(fn)
        first: BaseException | None = None
        try:
            fn(0)
        except BaseException as e:  # noqa: BLE001
            first = e
            on_error(e)
        for _ in range(n - 1):
            _, err = self._done.get()
            if err is not None:
                if first is None:
                    first = err
                    on_error(err)
        if first is not None:
            raise first

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for q in self._tasks:
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)
