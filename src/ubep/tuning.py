"""The tuning cache: count-worker choices `ubep tune` measured, keyed by workload.

`ubep tune` sweeps the count-worker number in the simulator and records the best one here;
a caller that plans (the shm runtime's worker pool, once per Buffer; the simulator with
`--use-tuned`) looks it up and passes it to `ubep.plan.costmodel.choose_count_workers(...,
tuned=...)`, which prefers it to the formula. `ubep.plan` itself stays pure: the file I/O
lives in this module.

The file is JSON at `$UBEP_TUNING_CACHE`, else `~/.cache/ubep/tuning.json`; entries are
keyed by (topology, workers, experts, batch) and hold the choice, its latency and where
it came from.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_path() -> Path:
    """Where the cache lives (`$UBEP_TUNING_CACHE` or `~/.cache/ubep/tuning.json`)."""
    env = os.environ.get("UBEP_TUNING_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ubep" / "tuning.json"


def _key(topology: str, workers: int, experts: int, batch: int) -> str:
    return f"{topology}|workers={workers}|experts={experts}|batch={batch}"


def load(path: Path | None = None) -> dict:
    """Every entry ({} when there is no cache or it cannot be read as JSON)."""
    p = path or cache_path()
    try:
        data = json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(topology: str, workers: int, experts: int, batch: int,
           path: Path | None = None) -> int | None:
    """The recorded count-worker choice for this workload, or None."""
    entry = load(path).get(_key(topology, workers, experts, batch))
    if isinstance(entry, dict) and isinstance(entry.get("count_workers"), int):
        return entry["count_workers"]
    return None


def choices(topology: str, workers: int, experts: int,
            path: Path | None = None) -> dict[int, int]:
    """Every recorded count-worker choice for (topology, workers, experts), keyed by batch.

    The runtime reads this once per Buffer, so the cache costs nothing per call.
    """
    prefix = f"{topology}|workers={workers}|experts={experts}|batch="
    out: dict[int, int] = {}
    for key, entry in load(path).items():
        if not key.startswith(prefix) or not isinstance(entry, dict):
            continue
        batch, n = key[len(prefix):], entry.get("count_workers")
        if batch.isdigit() and isinstance(n, int) and not isinstance(n, bool):
            out[int(batch)] = n
    return out


def record(topology: str, workers: int, experts: int, batch: int, count_workers: int, *,
           latency_us: float, source: str, path: Path | None = None) -> Path:
    """Store a choice (atomically replacing the file); returns the cache path."""
    if isinstance(count_workers, bool) or not isinstance(count_workers, int) or \
            not 1 <= count_workers < workers:
        raise ValueError(f"count_workers={count_workers!r} must be an int in [1, {workers - 1}]")
    p = path or cache_path()
    data = load(p)
    data[_key(topology, workers, experts, batch)] = {
        "count_workers": count_workers, "latency_us": round(float(latency_us), 3),
        "source": source}
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tuning-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, p)
    return p
