"""`python -m ubep.verify`: the same as `ubep verify` (see `ubep.verify.cli`)."""

import sys

from ubep.verify.cli import main

if __name__ == "__main__":
    sys.exit(main())
