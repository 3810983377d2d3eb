"""The direct path (`direct=True` and the default `direct="owned"`): each row copied once,
straight to its final place. `path.py` is `DirectPath` (one worker, in Python; owned or lent
areas), `native.py` `DirectNativePath` (its calls through `ubep.native`'s compiled entries and
door), `pool.py` `DirectPoolPath` (`workers` >= 2); `kernels.py` holds their Numba kernels and
`entries.py` the same kernels as C entry points, which `native/direct.cpp` and
`native/door.cpp` call by address."""
