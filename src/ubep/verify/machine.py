"""A tiny executable memory model: two threads, store buffers, every interleaving explored.

A protocol is two straight-line programs (sender, receiver) over named memory words. The
checker runs them under one memory model and explores *all* interleavings of thread steps
and store-buffer drains by depth-first search with memoization (a visited set of states),
so small instances (2 blocks, 2 epochs) are covered exhaustively in well under a second.

Memory models (`MODELS`):

* ``sc``    sequential consistency: a store is visible to the other thread at once.
* ``tso``   x86-TSO: each thread has a FIFO store buffer, drained oldest first; a thread's
            loads see its own buffered stores first (store forwarding).
* ``weak``  Arm/POWER-like: a reordering store buffer (buffered stores drain in any
            order, except that stores to one address stay in order and a *release* store
            drains only when it is the oldest entry: all earlier stores are visible first),
            and load-load reordering: a plain load may be performed early, before plain
            loads and non-acquire awaits that precede it (never before an acquire await).
* ``block`` the paper's hardware: a block store (all words of one block) is one atomic
            store; blocks drain in any order as under ``weak``; loads stay in order.

Every word holds a value and a ghost tag: the epoch whose store wrote it (0 = initial
contents or a receiver's re-arm). Protocols compute only with values; the checker judges a
delivered block by its tags, so it sees a stale or torn block even when the bytes of two
epochs happen to be equal.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MODELS = ("sc", "tso", "weak", "block")

# -- instructions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """Store `words` ((address, value) pairs) in order; `release` orders all earlier stores
    of the thread before it. Under ``block`` the words form one atomic store."""

    words: tuple[tuple[str, object], ...]
    tag: int
    release: bool = False


@dataclass(frozen=True)
class Fence:
    """Wait until this thread's store buffer is empty (mfence / barrier)."""


@dataclass(frozen=True)
class Await:
    """Spin until the word at `addr` satisfies `op` ("eq" | "ne") against `arg`; keep the
    value read in register `reg` (if given). An `acquire` load keeps later loads after it;
    under ``weak`` a later plain load may otherwise be performed before it."""

    addr: str
    op: str
    arg: object
    reg: str | None = None
    acquire: bool = True


@dataclass(frozen=True)
class Load:
    """Load the word at `addr` into register `reg`."""

    addr: str
    reg: str


@dataclass(frozen=True)
class Deliver:
    """Hand block `block` of epoch `epoch` to the caller, made of registers `regs`.

    The checker's verdict: every word tagged `epoch` is correct; words of several tags are
    a *torn* block; no word of `epoch` is a *stale* block."""

    block: int
    epoch: int
    regs: tuple[str, ...]


@dataclass(frozen=True)
class CheckSum:
    """Compare the values of `regs` (as a tuple) with the value in register `sum_reg`; on
    mismatch jump back to instruction `retry_pc` (the receiver re-reads the markers)."""

    regs: tuple[str, ...]
    sum_reg: str
    retry_pc: int


Instr = Store | Fence | Await | Load | Deliver | CheckSum


@dataclass(frozen=True)
class Protocol:
    """Two programs over named words, and what the protocol claims.

    Attributes:
        name: e.g. "tff" or "tff_flag_first".
        description: one line, what the variant does (and what is wrong with it, if broken).
        sender, receiver: the programs.
        initial: address -> initial value (tag 0); every address the programs use.
        claimed_models: the memory models under which the variant claims to deliver every
            block whole and of the right epoch, and to finish.
    """

    name: str
    description: str
    sender: tuple[Instr, ...]
    receiver: tuple[Instr, ...]
    initial: dict[str, object]
    claimed_models: tuple[str, ...]


# -- results ----------------------------------------------------------------------------------

VIOLATIONS = ("torn", "stale", "stuck")


@dataclass(frozen=True)
class CheckResult:
    """The outcome of exploring one protocol under one model.

    Attributes:
        protocol, model: what was checked.
        states: distinct states explored; transitions: edges between them.
        counterexamples: violation kind ("torn", "stale", "stuck") -> the steps of one
            shortest execution that shows it. Empty when the protocol is correct.
        outcomes: the register values of every finished execution, each a tuple of
            ("S" | "R", register, value) sorted; what litmus tests look at.
    """

    protocol: str
    model: str
    states: int
    transitions: int
    counterexamples: dict[str, tuple[str, ...]] = field(default_factory=dict)
    outcomes: frozenset = frozenset()

    @property
    def ok(self) -> bool:
        return not self.counterexamples

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "VIOLATED: " + ", ".join(sorted(self.counterexamples))
        return f"{self.protocol} under {self.model}: {verdict} ({self.states} states)"


# -- the machine ------------------------------------------------------------------------------

# A thread: (pc, registers as a sorted tuple of (name, (value, tag)), store buffer as a tuple
# of entries ((address index, value, tag) ..., release), loads performed early as a sorted
# tuple of instruction indices). A state: (memory, sender, receiver).


def _expand(program: tuple[Instr, ...], model: str) -> tuple[Instr, ...]:
    """Split multi-word stores into single-word stores (release on the last) unless the model
    has atomic blocks; jump targets are remapped to the expanded positions."""
    if model == "block":
        return program
    new_pc, out = [], []
    for ins in program:
        new_pc.append(len(out))
        if isinstance(ins, Store) and len(ins.words) > 1:
            for i, w in enumerate(ins.words):
                last = i == len(ins.words) - 1
                out.append(Store((w,), ins.tag, ins.release and last))
        else:
            out.append(ins)
    new_pc.append(len(out))
    return tuple(CheckSum(i.regs, i.sum_reg, new_pc[i.retry_pc]) if isinstance(i, CheckSum)
                 else i for i in out)


def _read(mem, sbuf, a):
    for entry in reversed(sbuf):
        for addr, v, t in entry[0]:
            if addr == a:
                return v, t
    return mem[a]


def _holds(op: str, value, arg) -> bool:
    if op == "eq":
        return value == arg
    if op == "ne":
        return value != arg
    raise ValueError(f"op={op!r} is not one of 'eq', 'ne'")


def _can_drain(model: str, sbuf, i: int) -> bool:
    if model == "tso":
        return i == 0
    entry = sbuf[i]
    if entry[1] and i:            # a release store waits for every earlier store
        return False
    addrs = {a for a, _, _ in entry[0]}
    return not any(a in addrs for earlier in sbuf[:i] for a, _, _ in earlier[0])


class _Run:
    def __init__(self, protocol: Protocol, model: str):
        if model not in MODELS:
            raise ValueError(f"model={model!r} is not one of {MODELS}")
        self.model = model
        self.addrs = sorted(protocol.initial)
        self.index = {a: i for i, a in enumerate(self.addrs)}
        self.programs = (_expand(protocol.sender, model), _expand(protocol.receiver, model))
        for prog in self.programs:
            for ins in prog:
                for a in _addresses(ins):
                    if a not in self.index:
                        raise ValueError(f"protocol {protocol.name!r} uses address {a!r} "
                                         f"missing from its initial memory")
        mem = tuple((protocol.initial[a], 0) for a in self.addrs)
        self.initial = (mem, (0, (), (), ()), (0, (), (), ()))

    def successors(self, state):
        """Yield (label, next state, violation kind or None)."""
        mem = state[0]
        for t in (0, 1):
            pc, regs, sbuf, early = state[1 + t]
            who = "S" if t == 0 else "R"

            def step(new_pc, new_regs=regs, new_sbuf=sbuf, new_mem=mem, new_early=early, _t=t):
                # instructions already performed early are skipped when the pc reaches them
                while new_pc in new_early:
                    new_early = tuple(e for e in new_early if e != new_pc)
                    new_pc += 1
                return self._with(state, _t, (new_pc, new_regs, new_sbuf, new_early), new_mem)

            # drain one buffered store
            for i in range(len(sbuf)):
                if _can_drain(self.model, sbuf, i):
                    m = list(mem)
                    for a, v, tag in sbuf[i][0]:
                        m[a] = (v, tag)
                    names = ",".join(self.addrs[a] for a, _, _ in sbuf[i][0])
                    yield (f"{who} drain {names}",
                           step(pc, new_sbuf=sbuf[:i] + sbuf[i + 1:], new_mem=tuple(m)), None)
            prog = self.programs[t]
            if pc >= len(prog):
                continue
            if self.model == "weak":
                yield from self._early_loads(state, t, who, step)
            ins = prog[pc]
            if isinstance(ins, Store):
                words = tuple((self.index[a], v, ins.tag) for a, v in ins.words)
                text = ",".join(f"{a}={v!r}" for a, v in ins.words)
                label = f"{who} {'st.rel' if ins.release else 'st'} {text}"
                if self.model == "sc":
                    m = list(mem)
                    for a, v, tag in words:
                        m[a] = (v, tag)
                    yield label, step(pc + 1, new_mem=tuple(m)), None
                else:
                    yield label, step(pc + 1, new_sbuf=sbuf + ((words, ins.release),)), None
            elif isinstance(ins, Fence):
                if not sbuf:
                    yield f"{who} fence", step(pc + 1), None
            elif isinstance(ins, (Await, Load)):
                got = _read(mem, sbuf, self.index[ins.addr])
                if isinstance(ins, Await) and not _holds(ins.op, got[0], ins.arg):
                    continue          # spinning changes nothing: not a step
                if ins.reg is not None:
                    regs = tuple(sorted(dict(regs, **{ins.reg: got}).items()))
                kind = "await" if isinstance(ins, Await) else "ld"
                yield f"{who} {kind} {ins.addr} -> {got[0]!r}", step(pc + 1, regs), None
            elif isinstance(ins, Deliver):
                r = dict(regs)
                tags = [r[n][1] for n in ins.regs]
                bad = None
                if any(tg != ins.epoch for tg in tags):
                    bad = "torn" if ins.epoch in tags else "stale"
                label = (f"{who} deliver block {ins.block} of epoch {ins.epoch}: written by "
                         f"epochs {tags}")
                yield label, step(pc + 1), bad
            elif isinstance(ins, CheckSum):
                r = dict(regs)
                same = tuple(r[n][0] for n in ins.regs) == r[ins.sum_reg][0]
                target = pc + 1 if same else ins.retry_pc
                yield (f"{who} checksum {'matches' if same else 'mismatch, retry'}",
                       step(target, new_early=()), None)

    def _early_loads(self, state, t, who, step):
        """Under ``weak``: plain loads performed before earlier plain loads and non-acquire
        awaits (load-load reordering). The window ends at anything else."""
        mem = state[0]
        pc, regs, sbuf, early = state[1 + t]
        prog = self.programs[t]
        written: set[str] = set()
        j = pc
        while j < len(prog):
            ins = prog[j]
            if j in early:
                j += 1
                continue
            if j > pc and isinstance(ins, Load) and ins.reg not in written:
                got = _read(mem, sbuf, self.index[ins.addr])
                new_regs = tuple(sorted(dict(regs, **{ins.reg: got}).items()))
                yield (f"{who} ld {ins.addr} -> {got[0]!r} (early, before instruction {pc})",
                       step(pc, new_regs, new_early=tuple(sorted(early + (j,)))), None)
            if isinstance(ins, Load) or (isinstance(ins, Await) and not ins.acquire):
                if ins.reg is not None:
                    written.add(ins.reg)
                j += 1
                continue
            break

    @staticmethod
    def _with(state, t, thread, mem):
        threads = list(state[1:])
        threads[t] = thread
        return (mem, threads[0], threads[1])

    def finished(self, state) -> bool:
        return all(state[1 + t][0] >= len(self.programs[t]) and not state[1 + t][2]
                   for t in (0, 1))


def _addresses(ins: Instr) -> list[str]:
    if isinstance(ins, Store):
        return [a for a, _ in ins.words]
    if isinstance(ins, (Await, Load)):
        return [ins.addr]
    return []


def check(protocol: Protocol, model: str, *, max_states: int = 2_000_000) -> CheckResult:
    """Explore every interleaving of `protocol` under `model`; report torn, stale, stuck.

    *stuck* means a reachable state from which the run can no longer finish (a deadlock, a
    lost wake-up, or a retry loop that can never succeed). Raises RuntimeError if the state
    space exceeds `max_states` (the instance is too big to call the check exhaustive).
    """
    run = _Run(protocol, model)
    parent: dict = {run.initial: None}
    depth: dict = {run.initial: 0}
    edges: dict = {}
    ends: set = set()
    found: dict[str, object] = {}
    queue = deque([run.initial])       # breadth first: counterexamples come out shortest
    transitions = 0
    while queue:
        s = queue.popleft()
        out = []
        for label, nxt, bad in run.successors(s):
            transitions += 1
            if bad is not None:
                if bad not in found:
                    found[bad] = (s, label)
                ends.add(s)       # a violating step ends that execution (already reported)
                continue
            out.append(nxt)
            if nxt not in parent:
                parent[nxt] = (s, label)
                depth[nxt] = depth[s] + 1
                if len(parent) > max_states:
                    raise RuntimeError(f"{protocol.name} under {model}: more than "
                                       f"{max_states} states; shrink the instance")
                queue.append(nxt)
        edges[s] = out

    # liveness: every reachable state must still be able to reach a finished state
    preds: dict = {s: [] for s in edges}
    for s, outs in edges.items():
        for n in outs:
            preds[n].append(s)
    live = {s for s in edges if run.finished(s)} | ends
    work = list(live)
    while work:
        for p in preds[work.pop()]:
            if p not in live:
                live.add(p)
                work.append(p)
    stuck = [s for s in edges if s not in live]
    if stuck:
        # the stuck state closest to the start (fewest steps) makes the clearest trace
        found["stuck"] = (min(stuck, key=depth.__getitem__), "(cannot finish from here)")

    examples = {kind: _trace(parent, s) + (label,) for kind, (s, label) in found.items()}
    outcomes = frozenset(
        tuple(sorted((who, reg, val) for who, t in (("S", s[1]), ("R", s[2]))
                     for reg, (val, _tag) in t[1]))
        for s in edges if run.finished(s))
    return CheckResult(protocol.name, model, len(parent), transitions, examples, outcomes)


def _trace(parent: dict, state) -> tuple[str, ...]:
    steps = []
    while parent[state] is not None:
        state, label = parent[state]
        steps.append(label)
    return tuple(reversed(steps))
