"""Elastic membership on the torch backend: collectives that survive a dead rank.

`Buffer(backend="torch", elastic=True)` (docs/reliability.md, "Elastic"). Each of a call's
collectives goes through `TorchElastic.all_to_all`; while every rank is active it is the
plain collective plus a wait bounded by the call's deadline. A collective that fails (gloo
reports a dead peer's closed connection) or is overdue starts a recovery, coordinated through
the process group's store:

1. the rank announces itself (`g<gen>/in/<rank>`: how many calls it completed) and raises the
   generation's flag, which ranks stalled in a collective poll and join;
2. it waits until every member has either announced itself or stopped its heartbeat (each
   rank's daemon thread bumps a counter in the store every `HEARTBEAT_S`; one that does not
   move for `DEAD_AFTER_S` is dead): no live rank is left out, no dead one waited for long;
3. the first to `compare_set` the decision (members, the fewest calls completed, how many
   collectives that call had) wins; every rank reads the same one;
4. the members form a group of their own, `torch.distributed.new_group(members,
   use_local_synchronization=True)`, on which every later collective runs: each call's
   buffers stay laid out by the original ranks, a collective sends the members' parts and
   zero-fills what inactive ranks would have sent (no tokens, no partial sums);
5. the call that failed is redone from its start by the ranks that failed it. A rank that had
   completed it already (the dead rank reached it before dying, and it returned) replays that
   call's collectives from the buffers it kept (`TorchBackend` alternates two scratch sets by
   call, so the previous call's send buffers are intact), and the redo runs as many
   collectives as that call had: every rank sees the survivors' data of every call exactly,
   and the dead rank's rows of the failed call all or none.

Nothing of this runs while nothing fails, beyond a bounded wait that polls the collective (as
the non-elastic path's `wait` does) and a per-call swap of the scratch set. The compiled path
(`native/torch_path.cpp`) runs the calls while the group is the original one: its waits call
`overdue` every `FLAG_EVERY_S`, and it writes each collective it runs into its door's REC
block (`Recorded`: ints, no Python object), from which a replay rebuilds them. When the rank that
hosts the store (rank 0 of the default group: the TCPStore master) dies, recovery is
impossible: `StoreHostDiedError` says so.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ubep.elastic import Membership
from ubep.errors import PeerTimeoutError, RankRemovedError, StoreHostDiedError
from ubep.native import layout as L
from ubep.runtime.collectives import all_to_all

#: how often each rank's heartbeat thread bumps its counter in the store, seconds
HEARTBEAT_S = 0.05
#: a rank whose heartbeat did not move for this long (while others recover) is dead, seconds
DEAD_AFTER_S = 1.0
#: how often a collective that is slow asks the store whether a recovery started, seconds
FLAG_EVERY_S = 0.01
#: how long a wait polls a collective before it also sleeps between polls, seconds
POLL_S = 2e-3


class Redo(Exception):
    """The call must start again (a recovery changed the members); internal."""


#: what a recovery raises itself (a restart, or a named end): passed on, never recovered from
_OURS = (Redo, StoreHostDiedError, RankRemovedError, PeerTimeoutError)


class Recorded(NamedTuple):
    """The collectives a compiled call ran, as its door wrote them (`layout`'s REC_* block,
    `torch_path.cpp`'s Watch: no Python object per collective), and the buffers they sent
    from: the door's scratch dict (its "send" and "csend") and header tensor."""
    rec: np.ndarray
    scratch: dict
    header: torch.Tensor | None

    def collectives(self, world: int) -> list[tuple]:
        """(flat uint8 input, input splits, output splits) of each, splits in bytes."""
        rec, out = self.rec, []
        size = L.rec_words(world)
        for i in range(int(rec[L.REC_COUNT])):
            r = rec[L.REC_FIRST + i * size:L.REC_FIRST + (i + 1) * size].tolist()
            src = (self.header if r[L.REC_SOURCE] == L.REC_HDR else
                   self.scratch["send" if r[L.REC_SOURCE] == L.REC_SEND else "csend"])
            at = r[L.REC_AT]
            out.append((src.reshape(-1).view(torch.uint8)[at:at + r[L.REC_BYTES]],
                        r[L.REC_SPLITS:L.REC_SPLITS + world], r[L.REC_SPLITS + world:]))
        return out




def _dead_store(e: BaseException) -> StoreHostDiedError:
    return StoreHostDiedError(
        f"the torch.distributed store that coordinates the elastic recovery is unreachable "
        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): the "
        f"process that hosts it (rank 0 of the default group, the TCPStore master) died; "
        f"recovery needs it, so this job cannot go on (run the store outside the ranks, "
        f"e.g. torchrun's c10d rendezvous on a separate host, to survive rank 0)")


class TorchElastic:
    """One rank's elastic state of a torch-backend Buffer: heartbeat, recovery, collectives
    on the current members' group."""

    def __init__(self, members: Membership, group, buffer_id: int, timeout_s: float,
                 on_regroup: Callable[[], None]):
        """`on_regroup`: called when the members' group replaces the original one (the
        torch backend turns its compiled path off: its collectives run on the original
        group)."""
        self.members = members
        self.rank, self.world = members.rank, members.world
        self.timeout_s = timeout_s
        self._orig = group if group is not None else dist.group.WORLD
        self.group = self._orig
        #: global rank of each rank of the Buffer's group (`new_group` takes global ranks)
        self._global = [dist.get_global_rank(self._orig, r) if group is not None else r
                        for r in range(self.world)]
        self.store = self._orig.get_group_store()
        job = os.environ.get("UBEP_JOB_ID", "")
        self._prefix = f"ubep/elastic/{job}/b{buffer_id}"
        self.gen = 0
        #: calls (dispatch or combine) this rank completed, and the collectives of the latest
        #: completed one and of the one in flight: (input, input splits, output splits)
        self.completed = 0
        self._last: list[tuple] = []
        self._now: list[tuple] = []
        #: a redo after recovery must run this many collectives (the servers' count), or 0;
        #: whether this rank replayed its previous call in the latest recovery
        self.redo_collectives = 0
        self.served = False
        self.drains = 0
        #: calls the compiled path took (`compiled`), and calls this rank replayed for others
        self.compiled_calls = 0
        self.replays = 0
        self._fruitless = 0             # recoveries in a row that found nobody dead
        self.deadline = float("inf")
        self._on_regroup = on_regroup
        self._stop = threading.Event()
        self._beat_store = self.store.clone()
        self._hb = threading.Thread(target=self._heartbeat, name=f"ubep-hb-b{buffer_id}",
                                    daemon=True)
        self._hb.start()

    # -- calls --------------------------------------------------------------------------------
    def begin(self) -> None:
        """A call starts: its deadline, an empty list of its collectives."""
        self.deadline = time.perf_counter() + self.timeout_s
        self._now = []

    def end(self) -> None:
        """A call completed: its collectives are the ones a replay would send."""
        self.completed += 1
        self._last, self._now = self._now, []
        self.redo_collectives = 0
        self.served = False

    def last_collectives(self) -> list[tuple]:
        """The latest completed call's collectives, in order: (flat input, input splits,
        output splits in its elements), the Python path's as they ran and the compiled
        path's from its record (`Recorded`): what a replay sends again."""
        out = []
        for c in self._last:
            out.extend(c.collectives(self.world) if type(c) is Recorded else [c])
        return out

    def close(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> None:
        key = f"{self._prefix}/hb/{self.rank}"
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat_store.add(key, 1)
            except RuntimeError:    # the store is gone: a recovery will say so
                return

    # -- collectives ----------------------------------------------------------------------------
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], async_op: bool = False):
        """`all_to_all_single` of flat tensors (byte or element splits by rank of the Buffer's
        group; empty = equal), on the current members (inactive ranks' parts: nothing sent,
        zeros received); a failure or a deadline passed starts the recovery (`Redo`).
        `async_op` while every rank is active: returns the collective's work, which `finish`
        waits for; else None (done)."""
        # flat, splits in elements (a split of a [n, m] tensor counts rows of m)
        o_row = output[0].numel() if output.dim() > 1 and output.shape[0] else 1
        i_row = input[0].numel() if input.dim() > 1 and input.shape[0] else 1
        output, input = output.view(-1), input.view(-1)
        output_splits = ([output.numel() // self.world] * self.world if not output_splits
                         else [int(n) * o_row for n in output_splits])
        input_splits = ([input.numel() // self.world] * self.world if not input_splits
                        else [int(n) * i_row for n in input_splits])
        self._now.append((input, input_splits, output_splits))
        return self._run(output, input, output_splits, input_splits, async_op)

    def overdue(self) -> None:
        """The compiled path's check while a collective is slow (every `FLAG_EVERY_S` past
        its first `POLL_S`): recover (`Redo`) when the deadline passed or another rank began
        a recovery."""
        if time.perf_counter() > self.deadline or self._flag_up():
            self.recover()

    def compiled(self, entry, recorded: Recorded, *args):
        """`entry(*args)`, a compiled call whose collectives `recorded` says (its door's
        record) and whose waits call `overdue`; a collective's failure (a RuntimeError from
        gloo) starts the recovery."""
        self._now.append(recorded)
        try:
            r = entry(*args)
            if r is not NotImplemented:
                self.compiled_calls += 1
            return r
        except _OURS:
            raise
        except Exception as e:   # noqa: BLE001 - a collective that failed: a peer died
            self.recover(e)

    def finish(self, work) -> None:
        """Wait for the work an `all_to_all(..., async_op=True)` returned (see `_run`)."""
        try:
            self._wait(work)
        except _OURS:
            raise
        except Exception as e:   # noqa: BLE001 - a collective that failed: a peer died
            self.recover(e)

    def _run(self, output, input, output_splits, input_splits, async_op: bool = False):
        try:
            if not self.members.any_inactive:
                work = all_to_all(self.group, output, input, output_splits, input_splits,
                                  async_op=True)
                if async_op:
                    return work
                self._wait(work)
                return None
            act = np.flatnonzero(self.members.active).tolist()
            o_at = np.concatenate([[0], np.cumsum(output_splits)]).tolist()
            i_at = np.concatenate([[0], np.cumsum(input_splits)]).tolist()
            send = torch.cat([input[i_at[r]:i_at[r + 1]] for r in act]) if act else input[:0]
            recv = output.new_empty(sum(output_splits[r] for r in act))
            work = all_to_all(self.group, recv, send, [output_splits[r] for r in act],
                              [input_splits[r] for r in act], async_op=True)
            self._wait(work)
            at = 0
            for r in range(self.world):
                n = output_splits[r]
                if r in act:
                    output[o_at[r]:o_at[r] + n].copy_(recv[at:at + n])
                    at += n
                else:
                    output[o_at[r]:o_at[r] + n].zero_()
            return None
        except _OURS:
            raise
        except Exception as e:   # noqa: BLE001 - a collective that failed: a peer died
            self.recover(e)

    def _wait(self, work) -> None:
        """Wait for `work`, bounded by the call's deadline, joining a recovery others began."""
        if work is None:
            return
        start = time.perf_counter()
        next_flag = start + POLL_S
        n = 0
        while not work.is_completed():
            now = time.perf_counter()
            if now - start < POLL_S:
                os.sched_yield()
                continue
            n += 1
            time.sleep(min(1e-3, 50e-6 * n))
            if now >= next_flag:
                next_flag = now + FLAG_EVERY_S
                if self._flag_up():
                    self.recover()
            if now > self.deadline:
                self.recover()
        work.wait()

    def check_removed(self) -> None:
        """Raise `RankRemovedError` if the other ranks removed this one (`set_active_ranks`)."""
        try:
            if self.store.check([f"{self._prefix}/removed/{self.rank}"]):
                self.members.remove([self.rank], "removed by set_active_ranks")
                raise RankRemovedError(self.rank, "removed by set_active_ranks")
        except dist.DistNetworkError as e:
            raise _dead_store(e) from e

    def _flag_up(self) -> bool:
        """Whether a recovery started (raises `RankRemovedError` if the others removed this
        rank with `set_active_ranks`)."""
        self.check_removed()
        try:
            return self.store.check([f"{self._prefix}/g{self.gen}/started"])
        except dist.DistNetworkError as e:
            raise _dead_store(e) from e

    # -- recovery -------------------------------------------------------------------------------
    def recover(self, cause: BaseException | None = None) -> None:
        """Agree with the live members on who is left, form their group, replay what another
        needs of my previous call; then `Redo` (the call in flight starts again). A
        collective that fails again after recoveries that found nobody dead raises `cause`
        (the failure is not a dead rank's)."""
        if self._fruitless >= 2 and cause is not None:
            raise cause
        before = self.members.version
        try:
            self._recover()
        except _OURS:
            raise
        except dist.DistNetworkError as e:     # the store's connection: its host is gone
            raise _dead_store(e) from e
        self._fruitless = 0 if self.members.version != before else self._fruitless + 1
        raise Redo()

    def _recover(self) -> None:
        g, store, pfx = self.gen, self.store, f"{self._prefix}/g{self.gen}"
        store.set(f"{pfx}/started", "1")
        ran = len(self.last_collectives())
        store.set(f"{pfx}/in/{self.rank}", f"{self.completed},{ran}")
        members = np.flatnonzero(self.members.active).tolist()
        beats: dict[int, tuple[int, float]] = {}
        deadline = time.perf_counter() + self.timeout_s
        while True:
            now = time.perf_counter()
            waiting, dead = [], []
            for r in members:
                if r == self.rank or store.check([f"{pfx}/in/{r}"]):
                    continue
                beat = int(store.add(f"{self._prefix}/hb/{r}", 0))
                seen = beats.get(r)
                if seen is None or seen[0] != beat:
                    beats[r] = (beat, now)
                    waiting.append(r)
                elif now - seen[1] > DEAD_AFTER_S:
                    dead.append(r)
                else:
                    waiting.append(r)
            if not waiting:
                break
            if now > deadline:
                raise PeerTimeoutError(self.rank, "elastic/recover", waiting, self.timeout_s,
                                       "live ranks did not join the recovery")
            time.sleep(0.005)
        live = [r for r in members if r not in dead]
        info = {r: tuple(int(v) for v in store.get(f"{pfx}/in/{r}").decode().split(","))
                for r in live}
        fewest = min(c for c, _ in info.values())
        served = max([n for c, n in info.values() if c > fewest], default=0)
        proposal = f"{','.join(map(str, live))};{fewest};{served}"
        decision = store.compare_set(f"{pfx}/decision", "", proposal).decode()
        if not decision:                    # (an older store returns what it had: empty)
            decision = store.get(f"{pfx}/decision").decode()
        ranks, fewest, served = decision.split(";")
        live = [int(r) for r in ranks.split(",")]
        fewest, served = int(fewest), int(served)
        if self.rank not in live:
            self.members.remove([self.rank], "found dead by the other ranks")
            raise RankRemovedError(self.rank, "the other ranks went on without it")
        self.members.remove([r for r in members if r not in live], "died")
        self.group = dist.new_group([self._global[r] for r in live],
                                    timeout=timedelta(seconds=self.timeout_s),
                                    use_local_synchronization=True)
        self._on_regroup()
        self.gen = g + 1
        self.served = self.completed > fewest
        if self.served:                     # others redo my previous call: replay it
            self.replays += 1
            for input, in_splits, out_splits in self.last_collectives():
                self._run(input.new_empty(sum(out_splits)), input, out_splits, in_splits)
        self.redo_collectives = 0 if self.served else served


    # -- set_active_ranks -----------------------------------------------------------------------
    def drain(self, mask: np.ndarray) -> None:
        """The remaining ranks agree on `mask` through the store (bounded; masks that differ
        are the same ValueError on each), mark the removed ranks (whose waits then raise
        `RankRemovedError`) and form their group."""
        self.drains += 1
        key = f"{self._prefix}/drain{self.drains}"
        mine = "".join("1" if b else "0" for b in mask)
        stay = [r for r in np.flatnonzero(mask & self.members.active).tolist()]
        try:
            self.store.set(f"{key}/{self.rank}", mine)
            deadline = time.perf_counter() + self.timeout_s
            while not self.store.check([f"{key}/{r}" for r in stay]):
                if time.perf_counter() > deadline:
                    missing = [r for r in stay if not self.store.check([f"{key}/{r}"])]
                    raise PeerTimeoutError(self.rank, "set_active_ranks", missing,
                                           self.timeout_s)
                time.sleep(0.002)
            masks = {r: self.store.get(f"{key}/{r}").decode() for r in stay}
        except dist.DistNetworkError as e:
            raise _dead_store(e) from e
        if any(m != mine for m in masks.values()):
            detail = "; ".join(f"rank {r} keeps {[i for i, c in enumerate(m) if c == '1']}"
                               for r, m in sorted(masks.items()))
            raise ValueError(f"set_active_ranks: the remaining ranks passed different masks "
                             f"({detail}); every rank that stays must pass the same mask")
        gone = [r for r in np.flatnonzero(~mask & self.members.active).tolist()]
        for r in gone:
            self.store.set(f"{self._prefix}/removed/{r}", "1")
        self.members.remove(gone, "removed by set_active_ranks")
        if gone:
            self.group = dist.new_group([self._global[r] for r in stay],
                                        timeout=timedelta(seconds=self.timeout_s),
                                        use_local_synchronization=True)
            self._on_regroup()
