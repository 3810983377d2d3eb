"""The CPU watch of `--validate-host`: it counts processes outside this process's tree and
not this process's own children. No timed assertion: a busy process is known to have used
CPU, the watch must see at least part of it."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks.cpuwatch import CpuWatch, OtherWork

BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t: pass\n"

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _detached_busy(seconds: float) -> int:
    """A busy Python process that is neither our descendant (its parent exits at once) nor
    in our process group (a new session); returns its pid."""
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=seconds)}' >/dev/null 2>&1 & "
         "echo $!"], check=True, capture_output=True, text=True, start_new_session=True)
    return int(out.stdout.strip())


def test_a_process_outside_my_tree_is_counted_and_my_child_is_not():
    mine = subprocess.Popen([sys.executable, "-c", BUSY.format(s=1.0)])
    try:
        with CpuWatch(period=0.05) as w:
            other = _detached_busy(0.8)
            time.sleep(1.0)
        mine.wait(timeout=10)
    finally:
        mine.kill()
    r = w.result
    assert str(other) in r.cpu_s and r.cpu_s[str(other)] > 0.1   # busy for 0.8 s
    assert str(mine.pid) not in r.cpu_s
    assert str(os.getpid()) not in r.cpu_s
    assert r.wall_s >= 1.0 and r.cores > 0
    assert "-c" in r.names[str(other)]


def test_other_work_reports_its_busiest_processes():
    r = OtherWork(wall_s=2.0, cpu_s={"1": 0.5, "2": 1.5, "3": 0.01},
                  names={"1": "a", "2": "b", "3": "c"})
    assert r.total_s == pytest.approx(2.01) and r.cores == pytest.approx(1.005)
    assert r.top() == [("b", 1.5), ("a", 0.5)]
    assert r.top(5) == [("b", 1.5), ("a", 0.5)]              # 0.01 s is below min_s
    assert "1.00 cores" in r.describe() and "b 1.5 s" in r.describe()
    assert OtherWork().cores == 0.0 and "0.00 cores" in OtherWork().describe()


def test_bad_period_is_an_error_naming_it():
    with pytest.raises(ValueError, match="period"):
        CpuWatch(period=0)


def test_my_child_orphaned_during_the_watch_stays_mine():
    """A child that outlives its parent (reparented away from this tree, as a forkserver
    whose parent exited) is still this tree's work, not another's."""
    with CpuWatch(period=0.05) as w:
        sh = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=0.8)}' "
                               ">/dev/null 2>&1 & echo $!; sleep 0.3"],
                              stdout=subprocess.PIPE, text=True)
        orphan = sh.stdout.readline().strip()
        sh.wait(timeout=10)
        time.sleep(0.8)
    assert orphan not in w.result.cpu_s


def test_an_orphan_of_my_process_group_from_before_the_watch_is_mine():
    """A child orphaned before the watch began (a finished bench's forkserver, still
    exiting) shares this process's group: not another's work."""
    sh = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=1.0)}' "
                           ">/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True)
    orphan = sh.stdout.readline().strip()
    sh.wait(timeout=10)
    with CpuWatch(period=0.05) as w:
        time.sleep(0.6)
    assert orphan not in w.result.cpu_s
