"""Which exchange the hybrid backend's next call runs, from costs the ranks measured.

Two families: "flat" (the torch backend's exchange, straight to the expert ranks) and the
hierarchical ones ("joint", "split": once per host, then forwarded through shared memory).
Small batches always run flat (`FLAT_BYTES` in `backend.py`). Above it, which is cheaper
depends on the link and the cores: on a slow link the hierarchical exchange's fewer bytes
win, on a fast one its extra copies lose. So each rank times its calls (dispatch plus
combine) per mode and batch bucket, and the ranks decide together:

* every rank must pick the same mode, so decisions use only what every rank knows alike:
  the largest batch of any rank (hierarchical calls; the bucket), the largest count any
  rank sent one peer (flat calls: the torch backend's headers), the call number, and the
  costs carried in hierarchical calls' headers (the largest of any rank: a call takes its
  slowest rank's time);
* a bucket's costs are known after `SAMPLES` + 1 calls in each mode (its first call
  grows buffers): a new bucket runs that many hierarchical calls, then as many flat ones
  (a probe), then a hierarchical call again, which carries the probe's cost to every
  rank;
* the mode not chosen runs once every `REPROBE` calls, times the rounded ratio of the two
  costs (up to `REPROBE_MOST`), so the choice follows the load while a re-measurement far
  costlier than the choice runs rarer: its share of the time stays under ~1/REPROBE;
* where the two cost about the same (within 1.5x), a mode's first call after the other's
  is not a typical one (its connections idle, its buffers out of cache: ~1.2-1.3x its
  steady cost at batch 128, 2 emulated hosts x 4 ranks) and would keep whichever mode
  came first; there a re-measurement runs two calls and keeps the second's cost;
* a chosen flat run times only its last call before a re-measurement (`untimed`), whose
  header carries that cost; the re-measured hierarchical cost reaches every rank with the
  next re-measurement (a flat choice follows the load one re-measurement late), and every
  other call of the run takes the Buffer's compiled door, as small batches do;
* a flat call leaves flat when the largest per-peer count changes bucket (the batch
  changed: a hierarchical call finds the new bucket).
"""

from __future__ import annotations

#: calls between re-measurements of the mode not chosen, where the two cost about the same
#: (times their costs' rounded ratio otherwise, at most REPROBE_MOST)
REPROBE = 32
REPROBE_MOST = 8 * REPROBE
#: a cost is the median of its latest SAMPLES calls: a typical call's, robust to a busy
#: host's spikes (a bucket's first call in a mode, which grows buffers, is not among them)
SAMPLES = 3


def bucket(n: int) -> int:
    """The bucket of a count: its bit length (1, 2-3, 4-7, ...)."""
    return int(n).bit_length()


class ModePicker:
    """The agreed choice between flat and hierarchical calls, and this rank's costs."""

    def __init__(self) -> None:
        #: this rank's latest costs, µs per dispatch + combine: {(bucket, flat?): [us, ...]}
        self._cost: dict[tuple[int, bool], list[float]] = {}
        #: the bucket of the largest batch the current choice was made for (agreed)
        self.bucket = 0
        #: why the current run of flat calls runs (agreed): "small" batches, a "probe"
        #: (`_left` more calls), "chosen" as the cheaper; "measure": hierarchical calls
        #: re-measured in a chosen flat run (`_left` more); None in other hierarchical calls
        self._run: str | None = "small"
        self._left = 0
        #: hierarchical calls in a row in the current bucket (agreed)
        self._hier_calls = 0
        #: in a chosen run: the per-peer count's bucket of its first call (agreed)
        self._flat_key: int | None = None
        #: calls between re-measurements, from the costs the choice was made with (agreed):
        #: REPROBE where they are within 1.5x (or not known yet), so a re-measurement runs
        #: past a first, untypical call (`_close`)
        self._every = REPROBE
        #: the families (flat?) of the last two calls: a first call after the other family's
        #: is not measured where the costs are close
        self._fam: tuple[bool | None, bool | None] = (None, None)

    def shared(self) -> tuple[int, int]:
        """(flat µs, hierarchical µs) this rank measured in the current bucket (0: not yet),
        what its hierarchical call's header carries."""
        return (_median(self._cost.get((self.bucket, True), [0])),
                _median(self._cost.get((self.bucket, False), [0])))

    def record(self, key_bucket: int, flat: bool, us: float) -> None:
        """One call's dispatch + combine time on this rank."""
        if self._close and self._fam[0] != self._fam[1]:
            return                      # a first call after the other family's
        last = self._cost.setdefault((key_bucket, flat), [])
        last.append(max(us, 1.0))
        del last[:-SAMPLES]

    def after_hier(self, batch_bucket: int, small: bool, flat_us: int, hier_us: int,
                   call: int) -> bool:
        """After a hierarchical call whose largest batch fell in `batch_bucket` (`small`:
        at most the flat threshold) and whose ranks' largest costs for the bucket the call
        was chosen in were `flat_us`, `hier_us` (0: unknown): is the next call flat?"""
        same = batch_bucket == self.bucket
        self._fam = (self._fam[1], False)
        self._hier_calls = self._hier_calls + 1 if same else 1
        self.bucket, self._flat_key = batch_bucket, None
        if small:
            self._run = "small"
            return True
        if self._run == "measure" and same:     # flat's chosen: the other family's calls
            self._left -= 1
            if self._left > 0:
                return False
        self._run = None
        if self._hier_calls <= SAMPLES:     # this bucket's costs: measure them first
            return False
        if flat_us and hier_us:
            ratio = max(flat_us, hier_us) / min(flat_us, hier_us)
            self._every = min(REPROBE_MOST, REPROBE * max(1, round(ratio)))
        if not flat_us or self._due(call) and flat_us >= hier_us:
            # then a hierarchical call, which carries the probe's cost
            self._run = "probe"
            self._left = SAMPLES + 1 if not flat_us else 2 if self._close else 1
            return True
        if flat_us < hier_us:
            self._run = "chosen"
            return True
        return False

    @property
    def _close(self) -> bool:
        """Whether the two costs are within 1.5x (`round` gives 1), or not known yet."""
        return self._every == REPROBE

    def _due(self, call: int) -> bool:
        """Whether call number `call` is the last before a re-measurement."""
        return (call + 1) % self._every == 0

    @property
    def small_run(self) -> bool:
        """Whether the calls run flat because their batches are small (no costs taken)."""
        return self._run == "small"

    def untimed(self, call: int) -> bool:
        """Whether flat call number `call` needs no cost taken: a small batch's, or a
        chosen run's but its last before a re-measurement (whose calls carry its cost to
        every rank; the run's costs are its latest SAMPLES such calls')."""
        return self._run == "small" or (
            self._run == "chosen" and not self._due(call))

    def after_flat(self, peer_bucket: int, small: bool, call: int) -> bool:
        """After a flat call whose largest per-peer count fell in `peer_bucket` (`small`:
        at most the flat threshold): is the next call flat?"""
        self._fam = (self._fam[1], True)
        if self._run == "probe":        # its calls, then a hierarchical one to share them
            self._left -= 1
            if self._left > 0:
                return True
            self._run = None
            return False
        if self._run == "chosen":
            if self._flat_key is None:
                self._flat_key = peer_bucket
            if peer_bucket == self._flat_key and not self._due(call):
                return True
            if peer_bucket == self._flat_key:   # time to re-measure (close costs: past a
                # first hierarchical call); the next re-measurement carries its cost
                self._run, self._left = "measure", 2 if self._close else 1
                return False
            self._run = None            # the batch changed
            return False
        if small:
            self._run = "small"
            return True
        self._run = None                # the batch grew past the threshold: measure it
        return False


def _median(values: list[float]) -> int:
    """The middle of `values` (the upper one of an even count), in whole µs."""
    return int(sorted(values)[len(values) // 2])
