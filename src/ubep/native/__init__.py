"""ubep's compiled fast paths: a small C++ torch extension, built once per environment.

What it holds: the input fast checks `Buffer.dispatch`/`Buffer.combine` run on every eager
call (`checks.cpp`; the rules are `ubep.validate`'s), and the shm direct path's one-worker
dispatch and combine as one C++ entry each (`direct.cpp`), which call the path's numba
kernels by address (`ubep.runtime.shm.direct.entries`), and the door (`door.cpp`): `Buffer`'s
common call on that path, from the input check to the stats, in one C++ call, which declines
(NotImplemented) whatever the Python layers would not take straight; the same door for the
one-worker staged path (`staged.cpp`, kernels `ubep.runtime.shm.staged.entries`);
and the torch backend's
CPU dispatch and combine (`torch_path.cpp`): its kernels (`ubep.runtime.torch_entries`) and its
collectives (`c10d::ProcessGroup::all_to_all_single` on the caller's group) with no Python
between them. Everything has a Python twin that gives the same results, used when the
extension is not built, so the library works without a compiler; `make install` builds it
(`python -m ubep.native build`, ~30 s: g++, ninja and the headers in torch's wheel).

The build lands in this environment (`sys.prefix`), in a folder named by the sources' hash,
torch's version and Python's, so an edited source, another torch or another venv never
loads a stale build. `UBEP_NATIVE=0` in the environment when a Buffer is made turns the
extension off for it (the Python twins run), as a way to compare the two or to rule the
extension out.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / f for f in ("module.cpp", "checks.cpp", "direct.cpp", "door.cpp",
                                    "staged.cpp", "torch_path.cpp"))
HEADERS = (_HERE / "native.h", _HERE / "layout.py")      # the layout: `ubep_layout.h`
NAME = "ubep_native"


def build_dir() -> Path:
    """Where this environment's build of the current sources lives (or would)."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(f"{torch.__version__} {sys.version} {sysconfig.get_platform()}".encode())
    return Path(sys.prefix) / "ubep-native" / h.hexdigest()[:16]


def _library(folder: Path) -> Path:
    return folder / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build(verbose: bool = False) -> Path:
    """Compile the extension into `build_dir()` (nothing to do if it is there); its path."""
    from torch.utils.cpp_extension import load

    folder = build_dir()
    lib = _library(folder)
    if not lib.exists():
        for old in folder.parent.glob("*"):      # builds of earlier sources or torches
            shutil.rmtree(old, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        import numpy

        from ubep.native.layout import header

        (folder / "ubep_layout.h").write_text(header())
        load(NAME, [str(s) for s in SOURCES], extra_cflags=["-O2"], build_directory=str(folder),
             extra_include_paths=[numpy.get_include(), str(folder)], verbose=verbose)
        if not lib.exists():        # torch names the library NAME.so
            lib = folder / f"{NAME}.so"
    _load.cache_clear()
    return lib


def load_native() -> ModuleType | None:
    """The built extension, or None (not built, or `UBEP_NATIVE=0` now). Never builds."""
    if os.environ.get("UBEP_NATIVE", "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> ModuleType | None:
    folder = build_dir()
    for lib in (_library(folder), folder / f"{NAME}.so"):
        if lib.exists():
            spec = importlib.util.spec_from_file_location(NAME, lib)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            from ubep.handle import CombineResult, DispatchHandle, DispatchResult
            from ubep.native.layout import NAMES
            from ubep.stats import DeferredStats

            # the classes its results are made of, and the names it uses on Python objects
            mod.set_result_types(DispatchHandle, DispatchResult, CombineResult, DeferredStats,
                                 NAMES)
            return mod
    return None


def status() -> str:
    """A few words for reports: whether the compiled paths run, and why not."""
    if os.environ.get("UBEP_NATIVE", "1") == "0":
        return "ubep.native off (UBEP_NATIVE=0)"
    if load_native() is None:
        return "ubep.native not built (python -m ubep.native build)"
    return "ubep.native on"
