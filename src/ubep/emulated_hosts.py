"""Emulated hosts on one machine: run ranks as if they sat on separate hosts joined by a link.

Each emulated host is a network namespace (its own interfaces and addresses) and a mount
namespace with its own tmpfs on /dev/shm, so ranks of different hosts share no shared memory
(`host_memory_key()` differs) and talk only over the link, while ranks of one host share
their host's /dev/shm. Two hosts are joined by a veth pair; any other number by a Linux
bridge in a namespace of its own, one veth per host. `link_rate` puts a `tbf` qdisc on every
host's link, each direction (this kernel has tbf and htb but no netem: a link can be slowed,
not delayed). Every address lives on interfaces inside namespaces this module creates, and
every namespace is deleted when the run ends; a run whose parent was killed leaves namespaces
named after its pid, which the next run removes.

How it is built (as root; `ip` and `unshare` from iproute2 and util-linux):

    ip netns add ubep-emu-<pid>-<n>-h0 ...                  # one per host
    ip -n <h0> link add eth0 type veth peer name eth0 netns <h1>
    ip -n <hX> addr add 10.213.77.<X+1>/24 dev eth0         # then lo and eth0 up
    tc -n <hX> qdisc add dev eth0 root tbf rate R burst 256kb latency 50ms   # link_rate
    ip netns exec <hX> unshare -m --propagation private sh -c \\
        'mount -t tmpfs -o mode=1777 ubep-host /dev/shm && exec python -c <agent>'

Each host's agent holds its namespaces, lists its /dev/shm when asked (the leak check), and
exits when this process closes its stdin (so also when this process dies). Rank processes
come from the same forkserver as `run_ranks` (torch and ubep preloaded) and enter their
host's network and mount namespaces with setns(2) through the agent's /proc/<pid>/ns entries
before anything else, as `nsenter` does. A store keeper process on host 0 holds the group's
TCP store at 10.213.77.1:29500, as torchrun's agent on the first node does; every rank sets
`GLOO_SOCKET_IFNAME=eth0`, so gloo binds to the host's link address.

Not isolated: the rest of the file system (/tmp is shared, handy for reports), the PID
namespace, CPUs and memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ubep.rank_processes import (
    RankLaunch,
    context,
    default_threads,
    raise_first,
    run_processes,
)

#: the first three octets of every emulated host's address: host h is <SUBNET>.<h+1>/24
SUBNET = "10.213.77"
#: the link's interface name inside every emulated host (what `GLOO_SOCKET_IFNAME` names)
IFNAME = "eth0"
#: where host 0's store keeper listens (a fresh namespace: nothing else holds the port)
STORE_PORT = 29500
#: names of the namespaces of a run: <NS_PREFIX><pid>-<n>-h<host> and ...-sw (the bridge)
NS_PREFIX = "ubep-emu-"
#: most hosts one run can have (addresses .1 to .250 of the /24)
MAX_HOSTS = 250
#: deadline for building the hosts, starting their agents and the store keeper, seconds
SETUP_TIMEOUT_S = 60.0

_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_TC_RATE = re.compile(r"\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)")
_AGENT = ("import json, os, sys\n"
          "print(os.getpid(), flush=True)\n"
          "for _ in sys.stdin:\n"
          "    print(json.dumps(sorted(os.listdir('/dev/shm'))), flush=True)\n")
_AGENT_SHELL = ('mount -t tmpfs -o mode=1777 ubep-host /dev/shm && '
                'exec "$0" -I -S -c "$1"')
_runs = itertools.count()


class HostsUnavailableError(RuntimeError):
    """Emulated hosts cannot be made here (not root, no `ip`, no namespaces)."""


class ShmLeakError(RuntimeError):
    """Entries were left in an emulated host's /dev/shm after its ranks exited
    (`run_hosts(check_leaks=True)`); `leaks` maps host -> names."""

    def __init__(self, leaks: dict[int, list[str]]):
        self.leaks = leaks
        super().__init__("; ".join(f"emulated host {h} left {names} in /dev/shm"
                                   for h, names in sorted(leaks.items())))


class HostResults(list):
    """`run_hosts`' answer: a list of each global rank's result (or `RankFailure`), by rank.

    Attributes:
        hosts: `tuple[tuple[int, ...], ...]`, the global ranks of each host, host by host.
        leaks: `dict[int, list[str]]`, host -> names left in that host's /dev/shm after all
            its ranks exited (or were killed); only hosts that left something, so a clean
            run has `leaks == {}`.
    """

    def __init__(self, outcomes: Sequence[Any], hosts: tuple[tuple[int, ...], ...],
                 leaks: dict[int, list[str]]):
        super().__init__(outcomes)
        self.hosts, self.leaks = hosts, leaks


def hosts_available() -> tuple[bool, str]:
    """(True, "") where `run_hosts` can build emulated hosts, else (False, why): for
    `pytest.skip(why)`. Probes once per process by making and deleting a namespace."""
    return _probe()


@functools.cache
def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"emulated hosts need Linux namespaces, not {sys.platform}"
    if os.geteuid() != 0:
        return False, "emulated hosts need root (network and mount namespaces, tmpfs mounts)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return False, f"emulated hosts need `{tool}` on PATH"
    if not hasattr(os, "setns") and not hasattr(ctypes.CDLL(None), "setns"):
        return False, "emulated hosts need setns(2) (os.setns or libc's)"
    ns = f"{NS_PREFIX}{os.getpid()}-probe"
    try:
        _cmd(["ip", "netns", "add", ns])
        _cmd(["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh",
              "-c", "mount -t tmpfs ubep-probe /dev/shm"])
    except RuntimeError as e:
        return False, f"emulated hosts cannot be made here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return True, ""


def run_hosts(fn: Callable[..., Any], *args: Any, hosts: int | None = None,
              ranks_per_host: int | Sequence[int] = 2, link_rate: str | int | None = None,
              timeout_s: float = 120.0, return_exceptions: bool = False,
              env: dict[str, str] | None = None, pg_timeout_s: float = 60.0,
              threads_per_rank: int | None = None, check_leaks: bool = False) -> HostResults:
    """Run `fn(rank, world_size, *args)` on ranks spread over emulated hosts; return each
    rank's result, by global rank, as a `HostResults` list (with `.hosts` and `.leaks`).

    Arguments:
        fn: a module-level function (ranks import it); its result must be picklable.
        hosts: how many hosts (1 to 250); default 2, or `len(ranks_per_host)`.
        ranks_per_host: ranks on each host: one int for all, or one int per host, e.g.
            `(1, 2, 1)`. Global ranks go host by host: host 0 has ranks 0..n0-1, and so on.
        link_rate: each host's link speed in each direction, as tc writes it ("1gbit",
            "100mbit") or in bit/s as an int; None: as fast as the veth goes.
        timeout_s, return_exceptions, env, pg_timeout_s, threads_per_rank: as `run_ranks`.
            `env` is applied last, over what this sets for each rank: `GLOO_SOCKET_IFNAME`,
            `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
            `LOCAL_WORLD_SIZE` and `GROUP_RANK` (the host), as torchrun sets them.
        check_leaks: raise `ShmLeakError` if any host's /dev/shm is not empty after its ranks
            exited (a rank's failure is raised first unless `return_exceptions`).

    A rank that raises makes this raise `RankFailedError`; with `return_exceptions=True` it
    is a `RankFailure` entry ("exception", "died" when it exited without answering, e.g.
    SIGKILLed, or "timeout"). Raises `HostsUnavailableError` where `hosts_available()` is
    False. Every namespace, link and address of the run is gone when this returns or raises.
    """
    counts = _rank_counts(hosts, ranks_per_host)
    rate = _tc_rate(link_rate)
    ok, why = hosts_available()
    if not ok:
        raise HostsUnavailableError(why)
    if rate is not None and shutil.which("tc") is None:
        raise HostsUnavailableError("link_rate needs `tc` (iproute2) on PATH")
    sweep_stale()
    world = sum(counts)
    ranks_of = tuple(tuple(range(sum(counts[:h]), sum(counts[:h + 1])))
                     for h in range(len(counts)))
    prefix = f"{NS_PREFIX}{os.getpid()}-{next(_runs)}-"
    namespaces: list[str] = []
    agents: list[_HostAgent] = []
    keeper = None
    try:
        _build_links(prefix, len(counts), rate, namespaces)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        agents = [_HostAgent(f"{prefix}h{h}") for h in range(len(counts))]
        for a in agents:
            a.wait_ready(deadline)
        cwd = os.getcwd()
        enters = [functools.partial(join_host, a.pid, cwd) for a in agents]
        # the first run of a process also waits here for the forkserver to import torch
        keeper = _StoreKeeper(enters[0], world, pg_timeout_s, time.monotonic() + timeout_s)
        launches = _launches(ranks_of, enters, env, pg_timeout_s,
                             threads_per_rank or default_threads(world))
        outcomes = run_processes(fn, args, launches, timeout_s)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        leaks = {h: names for h, a in enumerate(agents) if (names := a.list_shm(deadline))}
    finally:
        if keeper is not None:
            keeper.stop()
        for a in agents:
            a.stop()
        _delete_namespaces(namespaces)
    result = HostResults(outcomes, ranks_of, leaks)
    if not return_exceptions:
        raise_first(outcomes)
    if check_leaks and leaks:
        raise ShmLeakError(leaks)
    return result


def join_host(agent_pid: int, cwd: str) -> None:
    """Move this process into the network and mount namespaces of the host whose agent is
    `agent_pid` (what `nsenter --net --mount` does), then back to `cwd`. Call it before any
    thread starts: a process whose threads share its file-system attributes cannot change
    its mount namespace."""
    fds = [os.open(f"/proc/{agent_pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
           for kind in ("net", "mnt")]
    try:
        _setns(fds[0], _CLONE_NEWNET)
        _setns(fds[1], _CLONE_NEWNS)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        os.chdir(cwd)   # joining a mount namespace moves the process to its root
    except OSError:
        pass


def sweep_stale() -> list[str]:
    """Delete namespaces of runs whose process is gone (named `<NS_PREFIX><pid>-...` with a
    dead pid); return their names. Namespaces of live runs are left alone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    stale = []
    for line in out.stdout.splitlines():
        name = line.split(" ", 1)[0]
        m = re.fullmatch(rf"{re.escape(NS_PREFIX)}(\d+)-.+", name)
        if m and not _alive(int(m.group(1))):
            stale.append(name)
    _delete_namespaces(stale)
    return stale


# -- building and removing the hosts ------------------------------------------------------------

def host_address(host: int) -> str:
    """Emulated host `host`'s address on its link."""
    return f"{SUBNET}.{host + 1}"


def _build_links(prefix: str, hosts: int, rate: str | None, namespaces: list[str]) -> None:
    """Make the namespaces (appended to `namespaces` as they exist, for the caller's cleanup)
    and the links: a veth pair for two hosts, else a bridge in namespace `<prefix>sw`."""
    names = [f"{prefix}h{h}" for h in range(hosts)]
    tbf = ["root", "tbf", "rate", str(rate), "burst", "256kb", "latency", "50ms"]
    for ns in names:
        _cmd(["ip", "netns", "add", ns])
        namespaces.append(ns)
    if hosts == 2:
        _cmd(["ip", "-n", names[0], "link", "add", IFNAME, "type", "veth", "peer", "name",
              IFNAME, "netns", names[1]])
    else:
        sw = f"{prefix}sw"
        _cmd(["ip", "netns", "add", sw])
        namespaces.append(sw)
        _cmd(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h, ns in enumerate(names):
            port = f"p{h}"
            _cmd(["ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port,
                  "netns", sw])
            _cmd(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _cmd(["ip", "-n", sw, "link", "set", port, "up"])
            if rate is not None:   # the bridge's side of the link: traffic towards host h
                _cmd(["tc", "-n", sw, "qdisc", "add", "dev", port, *tbf])
    for h, ns in enumerate(names):
        _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        _cmd(["ip", "-n", ns, "addr", "add", f"{host_address(h)}/24", "dev", IFNAME])
        _cmd(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        if rate is not None:       # host h's side: traffic from host h
            _cmd(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, *tbf])


def _delete_namespaces(names: Sequence[str]) -> None:
    """`ip netns del` each (its veths go with it); warn about any that stays."""
    for ns in reversed(names):
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                           timeout=30)
        if r.returncode and "No such file" not in r.stderr:
            warnings.warn(f"emulated hosts: `ip netns del {ns}` failed: {r.stderr.strip()}",
                          RuntimeWarning, stacklevel=2)


def _launches(ranks_of: tuple[tuple[int, ...], ...], enters: list[Callable[[], None]],
              env: dict[str, str] | None, pg_timeout_s: float, threads: int) -> list[RankLaunch]:
    world = sum(len(r) for r in ranks_of)
    job = f"h{os.getpid()}x{int(time.time() * 1e3) % 100000}"
    launches = []
    for h, ranks in enumerate(ranks_of):
        for local, rank in enumerate(ranks):
            rank_env = {"UBEP_JOB_ID": job, "GLOO_SOCKET_IFNAME": IFNAME,
                        "MASTER_ADDR": host_address(0), "MASTER_PORT": str(STORE_PORT),
                        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                        "LOCAL_WORLD_SIZE": str(len(ranks)), "GROUP_RANK": str(h),
                        **(env or {})}
            launches.append(RankLaunch(host_address(0), STORE_PORT, rank_env, pg_timeout_s,
                                       threads, enters[h], name=f"ubep-h{h}-rank"))
    return launches


class _HostAgent:
    """One emulated host's agent process: holds its namespaces and its /dev/shm tmpfs, lists
    that /dev/shm on request, exits when its stdin closes (so also when this process dies)."""

    def __init__(self, ns: str):
        self.ns, self.pid, self._buf = ns, 0, b""
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh", "-c",
             _AGENT_SHELL, sys.executable, _AGENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait_ready(self, deadline: float) -> None:
        self.pid = int(self._readline(deadline))

    def list_shm(self, deadline: float) -> list[str]:
        """Names in this host's /dev/shm now."""
        self.proc.stdin.write(b"ls\n")
        self.proc.stdin.flush()
        return json.loads(self._readline(deadline))

    def _readline(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"emulated host {self.ns}: its agent did not answer in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(5)
                err = self.proc.stderr.read().decode(errors="replace").strip()
                raise RuntimeError(f"emulated host {self.ns}: its agent exited "
                                   f"({self.proc.returncode}): {err}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


class _StoreKeeper:
    """A process on host 0 that holds the group's TCP store until `stop()`: the store outlives
    any rank, so a lost rank 0 does not take it from the others."""

    def __init__(self, enter: Callable[[], None], world: int, pg_timeout_s: float,
                 deadline: float):
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_keep_store, name="ubep-store",
                                args=(enter, world, pg_timeout_s, child))
        self.proc.start()
        child.close()
        left = max(0.0, deadline - time.monotonic())
        try:
            status, msg = self.conn.recv() if self.conn.poll(left) else ("late", "no answer")
        except EOFError:
            status, msg = "died", f"exit code {self.proc.exitcode}"
        if status != "ready":
            self.stop()
            raise RuntimeError(f"the store keeper on emulated host 0 failed: {status}: {msg}")

    def stop(self) -> None:
        self.conn.close()   # the keeper's recv() ends: it drops the store and exits
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def _keep_store(enter: Callable[[], None], world: int, pg_timeout_s: float, conn) -> None:
    try:
        enter()
        import torch.distributed as dist

        store = dist.TCPStore(host_address(0), STORE_PORT, world + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=pg_timeout_s))
        conn.send(("ready", ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, if it still listens
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        conn.recv()
    except EOFError:
        pass
    del store


# -- small helpers ------------------------------------------------------------------------------

def _rank_counts(hosts: int | None, ranks_per_host: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(ranks_per_host, int) and not isinstance(ranks_per_host, bool):
        counts = (ranks_per_host,) * (2 if hosts is None else hosts)
    elif isinstance(ranks_per_host, Sequence) and not isinstance(ranks_per_host, str):
        counts = tuple(ranks_per_host)
        if hosts is not None and hosts != len(counts):
            raise ValueError(f"hosts={hosts} but ranks_per_host={ranks_per_host!r} has "
                             f"{len(counts)} entries: give one count per host")
    else:
        raise TypeError(f"ranks_per_host={ranks_per_host!r} must be an int or a sequence of "
                        f"ints, one per host")
    if not 1 <= len(counts) <= MAX_HOSTS:
        raise ValueError(f"hosts={len(counts)} must be between 1 and {MAX_HOSTS}")
    for c in counts:
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r}: every host needs an int "
                             f">= 1 ranks")
    return counts


def _tc_rate(link_rate: str | int | None) -> str | None:
    if link_rate is None:
        return None
    if isinstance(link_rate, int) and not isinstance(link_rate, bool) and link_rate > 0:
        return f"{link_rate}bit"
    if isinstance(link_rate, str) and _TC_RATE.fullmatch(link_rate.strip().lower()):
        return link_rate.strip().lower()
    raise ValueError(f"link_rate={link_rate!r} must be a tc rate such as '1gbit' or "
                     f"'100mbit' (a number, then bit, kbit, mbit, gbit or tbit; bps for "
                     f"bytes) or a positive int of bit/s")


def _cmd(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()}")


def _setns(fd: int, nstype: int) -> None:
    if hasattr(os, "setns"):   # Python >= 3.12
        os.setns(fd, nstype)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
