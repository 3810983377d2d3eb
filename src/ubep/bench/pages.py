"""Page-aligned scratch for the bounds: copies the host is not slowed down on by accident.

glibc copies a few KiB and more with `rep movsb` where the CPU advertises fast string
moves. On AMD Zen 3 (this project's CI host: EPYC, family 25) that instruction runs ~8x
slower when the destination lies 1-31 bytes past the source modulo 4 KiB (measured here
with glibc 2.36: 112 KiB in 39 µs against 4.8 µs at any other offset; glibc 2.39 avoids
`rep movsb` for such page aliasing). Two numpy arrays malloc placed back to back on the
heap sit exactly 16 bytes apart modulo 4 KiB (the chunk header), so a bound copied
between them measured the slow case, not the fastest copy the core has. Buffers from
here start on a page, so a copy between two of them is never aliased that way.
"""

from __future__ import annotations

import mmap

import numpy as np


def page_aligned(nbytes: int) -> np.ndarray:
    """`nbytes` of zeroed uint8 at a page-aligned address, in 4 KiB pages: an anonymous
    shared mapping, the memory the runtime's regions are (numpy would advise huge pages
    for 4 MiB and more). Kept alive by the array."""
    m = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(m, np.uint8)[:nbytes]
