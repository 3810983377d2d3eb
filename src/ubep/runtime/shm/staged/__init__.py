"""The staged one-worker path (`direct=False`, one worker): rows through each peer's window,
the whole call in the calling thread. `path.py` is `SinglePath`; `kernels.py` its fused
Numba entries; `entries.py` them as C entry points for `ubep.native`'s staged door
(`staged.cpp`)."""
