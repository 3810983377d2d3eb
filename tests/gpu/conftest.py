"""tests/gpu run ubep.gpu's Triton kernels on CPU under Triton's interpreter.

The variable must be set before Triton builds a kernel (when ubep.gpu is first imported).
The interpreter runs a kernel's programs one after another in id order; the kernels only
ever wait on lower ids, so they run there as they would with every program resident.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
