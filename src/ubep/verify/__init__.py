"""Protocol check of the Data-as-Flag sync variants (sw, tff, dc, sp).

`ubep.verify.machine` is a tiny executable memory model (sc, x86-TSO, a weak Arm-like model
with a reordering store buffer and load reordering, and the paper's atomic-block hardware)
that explores every
interleaving of a sender and a receiver; `ubep.verify.protocols` writes each variant, and
deliberately broken ones, as programs for it. `check_all()` runs the whole matrix:

    python -m ubep.verify          # a table: variant x model -> ok / torn / stale / stuck
"""

from ubep.verify.machine import MODELS, CheckResult, Protocol, check
from ubep.verify.protocols import SENTINEL, variants


def check_all(blocks: int = 2, epochs: int = 2) -> list[tuple[Protocol, str, list[CheckResult]]]:
    """Check every variant under every model, with data distinct per epoch and repeated.

    Returns (protocol, model, [result for distinct data, result for repeated data]) rows, in
    the order of `variants()` and `MODELS`.
    """
    rows = []
    by_name = {False: variants(blocks, epochs, False), True: variants(blocks, epochs, True)}
    for i, proto in enumerate(by_name[False]):
        for model in MODELS:
            rows.append((proto, model, [check(by_name[rep][i], model) for rep in (False, True)]))
    return rows


__all__ = ["MODELS", "CheckResult", "Protocol", "check", "check_all", "variants", "SENTINEL"]
