"""The four sync variants (and deliberately broken ones) as programs for `ubep.verify.machine`.

One sender streams `blocks` blocks per epoch to one receiver, for `epochs` epochs, through
the same window (no reset pass between epochs). Every block has two words: a payload word
and a last word that is the flag (tff), the marker (dc, sp) or a second payload word (sw).
After consuming an epoch the receiver releases the window with an ack (a release store);
the sender waits for the ack before it reuses the window. In the shm runtime windows are
double-buffered by epoch parity and a sender reuses a half only after a release-stored
message every receiver sends once it finished with that half: the counts or hellos of the
next call of the same kind (back-to-back calls), or the hellos of the combine / counts of
the dispatch in between (alternating calls, which stay in one half; `docs/sync.md`). That
message is the ack. The model uses one window and an explicit ack, a stricter reuse, so that
re-arming (sp) is checked against a sender that reuses the window at once.

As in the runtime (`ubep.plan.blocks`), each block's last word is written last: the tff flag,
or the marker word (a payload word) of sw, dc and sp.

Data values are either distinct per epoch or the same in every epoch ("repeat": the same
tokens dispatched twice), which is what makes a stale block look valid by its bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from ubep.verify.machine import (
    MODELS,
    Await,
    CheckSum,
    Deliver,
    Instr,
    Load,
    Protocol,
    Store,
)

#: the sentinel of sp, a value the payload words never hold (unless a test makes them)
SENTINEL = -1

ALL = MODELS
ORDERED = ("sc", "tso")          # program order of stores is enough (x86-TSO)


def _value(epoch: int, block: int, word: int, repeat: bool) -> int:
    return (0 if repeat else 100 * epoch) + 10 * block + word + 1


def _ack(epoch: int, release: bool = True) -> Store:
    return Store((("ack", epoch),), 0, release)


def _wait_ack(epoch: int) -> Await:
    return Await("ack", "eq", epoch)


def _two_sided(send_epoch: Callable[[int], list[Instr]],
               recv_epoch: Callable[[int, int], list[Instr]], epochs: int,
               ack_release: bool = True) -> tuple[tuple[Instr, ...], tuple[Instr, ...]]:
    sender: list[Instr] = []
    receiver: list[Instr] = []
    for e in range(1, epochs + 1):
        if e > 1:
            sender.append(_wait_ack(e - 1))
        sender += send_epoch(e)
        receiver += recv_epoch(e, len(receiver))
        if e < epochs:
            receiver.append(_ack(e, ack_release))
    return tuple(sender), tuple(receiver)


def _words(blocks: int) -> dict[str, object]:
    return {f"b{b}.{w}": 0 for b in range(blocks) for w in (0, 1)}


# -- sw: data, then one flag per batch ------------------------------------------------------

def sw(blocks: int = 2, epochs: int = 2, repeat: bool = False, *, release: bool = True,
       flag_first: bool = False) -> Protocol:
    """Stop-and-wait: all payload blocks, then the batch flag (= epoch) with a release store
    (the fence: every earlier store is visible before the flag)."""
    def send(e):
        data = [Store(tuple((f"b{b}.{w}", _value(e, b, w, repeat)) for w in (0, 1)), e)
                for b in range(blocks)]
        flag = [Store((("flag", e),), e, release=release)]
        return flag + data if flag_first else data + flag

    def recv(e, _pc):
        out: list[Instr] = [Await("flag", "eq", e)]
        for b in range(blocks):
            out += [Load(f"b{b}.0", "p"), Load(f"b{b}.1", "q"), Deliver(b, e, ("p", "q"))]
        return out

    s, r = _two_sided(send, recv, epochs)
    name, claimed, what = "sw", ALL, "payload blocks, then a batch flag, release store (fence)"
    if flag_first:
        name, claimed, what = "sw_flag_first", (), "BROKEN: batch flag stored before the payload"
    elif not release:
        name, claimed, what = "sw_plain", ORDERED, "batch flag a plain store after the data"
    return Protocol(name, what, s, r, {**_words(blocks), "flag": 0, "ack": 0}, claimed)


# -- tff: a flag word inside every block, stored last ------------------------------------------

def tff(blocks: int = 2, epochs: int = 2, repeat: bool = False, *, release: bool = True,
        acquire: bool = True, flag_first: bool = False) -> Protocol:
    """Token-flag fusion: each block is (payload, flag=epoch); the flag is stored last."""
    def send(e):
        out: list[Instr] = []
        for b in range(blocks):
            payload, flag = (f"b{b}.0", _value(e, b, 0, repeat)), (f"b{b}.1", e)
            if flag_first:       # two separate stores, flag first: wrong on every machine
                out += [Store((flag,), e, release), Store((payload,), e)]
            else:
                out.append(Store((payload, flag), e, release))
        return out

    def recv(e, _pc):
        out: list[Instr] = []
        for b in range(blocks):
            out += [Await(f"b{b}.1", "eq", e, "f", acquire), Load(f"b{b}.0", "p"),
                    Deliver(b, e, ("p", "f"))]
        return out

    s, r = _two_sided(send, recv, epochs)
    name, claimed, what = "tff", ALL, "flag word last in each block, release store"
    if flag_first:
        name, claimed, what = "tff_flag_first", (), "BROKEN: flag stored before the payload"
    elif not release:
        name, claimed, what = ("tff_plain", ORDERED + ("block",),
                               "flag last in each block, plain store (no release)")
    elif not acquire:
        name, claimed, what = ("tff_plain_load", ORDERED + ("block",),
                               "release flag, but the reader polls it with plain loads")
    return Protocol(name, what, s, r, {**_words(blocks), "ack": 0}, claimed)


# -- dc: no flags; a checksum of the blocks' marker words, then the epoch ---------------------

def dc(blocks: int = 2, epochs: int = 2, repeat: bool = False, *,
       release: bool = True) -> Protocol:
    """Data-for-checksum: blocks (payload, marker); then the checksum word, then the epoch
    word of the batch slot (release)."""
    def send(e):
        out: list[Instr] = [Store(tuple((f"b{b}.{w}", _value(e, b, w, repeat)) for w in (0, 1)),
                                  e) for b in range(blocks)]
        markers = tuple(_value(e, b, 1, repeat) for b in range(blocks))
        out.append(Store((("sum", markers), ("sum.epoch", e)), e, release))
        return out

    def recv(e, pc):
        out: list[Instr] = [Await("sum.epoch", "eq", e)]
        loop = pc + len(out)           # a mismatch re-reads the checksum and the markers
        out.append(Load("sum", "c"))
        out += [Load(f"b{b}.1", f"m{b}") for b in range(blocks)]
        out.append(CheckSum(tuple(f"m{b}" for b in range(blocks)), "c", loop))
        for b in range(blocks):
            out += [Load(f"b{b}.0", "p"), Deliver(b, e, ("p", f"m{b}"))]
        return out

    s, r = _two_sided(send, recv, epochs)
    name, claimed, what = "dc", ALL, "checksum, then epoch word stored last (release)"
    if not release:
        name, claimed, what = "dc_plain", ORDERED, "checksum and epoch words, plain stores"
    return Protocol(name, what, s, r, {**_words(blocks), "sum": (), "sum.epoch": 0, "ack": 0},
                    claimed)


# -- sp: the receiver arms marker words with a sentinel and re-arms after consuming -------------

def sp(blocks: int = 2, epochs: int = 2, repeat: bool = False, *, release: bool = True,
       acquire: bool = True, rearm: bool = True, marker_first: bool = False,
       ack_release: bool = True, sentinel_in_data: bool = False) -> Protocol:
    """Sentinel polling: a block has arrived when its marker word is not the sentinel."""
    def send(e):
        out: list[Instr] = []
        for b in range(blocks):
            marker = SENTINEL if sentinel_in_data and e == epochs else _value(e, b, 1, repeat)
            payload, mark = (f"b{b}.0", _value(e, b, 0, repeat)), (f"b{b}.1", marker)
            if marker_first:
                out += [Store((mark,), e, release), Store((payload,), e)]
            else:
                out.append(Store((payload, mark), e, release))
        return out

    def recv(e, _pc):
        out: list[Instr] = []
        for b in range(blocks):
            out += [Await(f"b{b}.1", "ne", SENTINEL, "m", acquire), Load(f"b{b}.0", "p"),
                    Deliver(b, e, ("p", "m"))]
            if rearm:
                out.append(Store(((f"b{b}.1", SENTINEL),), 0))
        return out

    s, r = _two_sided(send, recv, epochs, ack_release)
    name, claimed, what = "sp", ALL, "marker last in each block (release), re-armed, ack release"
    if marker_first:
        name, claimed, what = "sp_marker_first", (), "BROKEN: marker stored before the payload"
    elif not rearm:
        name, claimed, what = "sp_no_rearm", (), "BROKEN: receiver never re-arms the sentinel"
    elif sentinel_in_data:
        name, claimed, what = ("sp_sentinel_in_data", (),
                               "BROKEN: a payload holds the sentinel (what the input check stops)")
    elif not ack_release:
        name, claimed, what = ("sp_plain_ack", ORDERED,
                               "re-arm then a plain ack store (no release)")
    elif not release:
        name, claimed, what = ("sp_plain", ORDERED + ("block",),
                               "marker last in each block, plain store (no release)")
    elif not acquire:
        name, claimed, what = ("sp_plain_load", ORDERED + ("block",),
                               "release marker, but the reader polls it with plain loads")
    words = {f"b{b}.{w}": (SENTINEL if w == 1 else 0) for b in range(blocks) for w in (0, 1)}
    return Protocol(name, what, s, r, {**words, "ack": 0}, claimed)


# -- direct: the row, then its meta word (weight | epoch) as the flag, release store -----------

def direct(blocks: int = 2, epochs: int = 2, repeat: bool = False, *, release: bool = True,
           flag_first: bool = False) -> Protocol:
    """`Buffer(direct=True)`: each row (a "block" here) is copied to its final place, then its
    meta word (the weight's bits | epoch) is release-stored; the reader acquire-polls that
    word, then reads the row. Two separate stores per row (the row is not inside a block)."""
    def send(e):
        out: list[Instr] = []
        for b in range(blocks):
            row, meta = (f"b{b}.0", _value(e, b, 0, repeat)), (f"b{b}.1", e)
            pair = [Store((row,), e), Store((meta,), e, release)]
            out += pair[::-1] if flag_first else pair
        return out

    def recv(e, _pc):
        out: list[Instr] = []
        for b in range(blocks):
            out += [Await(f"b{b}.1", "eq", e, "f"), Load(f"b{b}.0", "p"),
                    Deliver(b, e, ("p", "f"))]
        return out

    s, r = _two_sided(send, recv, epochs)
    name, claimed, what = "direct", ALL, "row at its final place, then its meta word, release"
    if flag_first:
        name, claimed, what = ("direct_flag_first", (),
                               "BROKEN: meta word stored before the row")
    elif not release:
        name, claimed, what = ("direct_plain", ORDERED,
                               "meta word a plain store after the row (no release)")
    return Protocol(name, what, s, r, {**_words(blocks), "ack": 0}, claimed)


def variants(blocks: int = 2, epochs: int = 2, repeat: bool = False) -> list[Protocol]:
    """The four variants as the runtime builds them, then weaker and broken ones."""
    kw = {"blocks": blocks, "epochs": epochs, "repeat": repeat}
    return [
        sw(**kw), tff(**kw), dc(**kw), sp(**kw), direct(**kw),
        direct(**kw, release=False), direct(**kw, flag_first=True),
        sw(**kw, release=False), tff(**kw, release=False), dc(**kw, release=False),
        sp(**kw, release=False), sp(**kw, ack_release=False),
        tff(**kw, acquire=False), sp(**kw, acquire=False),
        sw(**kw, flag_first=True), tff(**kw, flag_first=True), sp(**kw, marker_first=True),
        sp(**kw, rearm=False), sp(**kw, sentinel_in_data=True),
    ]
