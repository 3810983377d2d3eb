"""`python -m ubep.native build [-v]`: compile the extension for this environment."""

from __future__ import annotations

import sys

from ubep.native import build, load_native


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "build":
        print("usage: python -m ubep.native build [-v]", file=sys.stderr)
        return 2
    lib = build(verbose="-v" in argv)
    if load_native() is None:
        print(f"ubep.native: built {lib} but cannot load it", file=sys.stderr)
        return 1
    print(f"ubep.native: {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
