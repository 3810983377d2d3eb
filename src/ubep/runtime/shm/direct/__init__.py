"""The direct path (`direct=True` and the default `direct="owned"`): each row copied once,
straight to its final place. `path.py` is `DirectPath`; `kernels.py` its Numba kernels;
`entries.py` the same kernels as C entry points, which `ubep.native`'s door (`door.cpp`,
`direct.cpp`) calls by address."""
