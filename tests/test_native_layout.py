"""The one definition Python and `ubep.native`'s C++ share (`ubep.native.layout`): the header
the build generates from it, the names C++ uses on Python objects, and no C++ source that
reads or writes a Python attribute by a name of its own."""

from __future__ import annotations

import re
from pathlib import Path

import ubep.native
from ubep.handle import new_combine_result, new_dispatch_result, new_handle
from ubep.native import layout
from ubep.runtime.torch_backend import _TorchState
from ubep.stats import DeferredStats

CPP = sorted(Path(ubep.native.__file__).parent.glob("*.[ch]*"))


def test_every_block_is_numbered_densely_and_its_length_follows_its_last_word():
    for _, prefix in layout.ENUMS:
        if prefix == "REC_":    # three small enums and a count (a record's parts)
            assert layout.REC_FIRST == 1 and layout.REC_SPLITS == 3 and layout.REC_CSEND == 2
            continue
        words = [(k, v) for k, v in vars(layout).items()
                 if k.startswith(prefix) and type(v) is int and k != f"{prefix}LEN"]
        values = sorted(v for _, v in words)
        if prefix == "K_":      # K_ERR (then K_CHECK_NS) follows res_offsets' 8 words
            values.remove(layout.K_ERR)
            values.remove(layout.K_CHECK_NS)
            assert layout.K_ERR == layout.K_OFFSETS + 8
            assert layout.K_CHECK_NS == layout.K_ERR + 1
        assert values == list(range(len(values))), prefix
        length = getattr(layout, f"{prefix}LEN", None)
        assert length is None or length == max(v for _, v in words) + 1, prefix


def test_the_header_defines_each_word_with_python_s_value():
    h = layout.header()
    for _, prefix in layout.ENUMS:
        for k, v in vars(layout).items():
            if k.startswith(prefix) and type(v) is int:
                assert re.search(rf"\b{k} = {v}\b", h), k
    for prefix, (fields, first_int) in layout.DOORS.items():
        for i, f in enumerate(fields):
            assert f"{prefix}_{f.upper()} = {i}," in h
        assert f"{prefix}_LEN = {len(fields)}" in h
        if first_int:
            assert f"{prefix}_INTS = {fields.index(first_int)}" in h


def test_the_build_folder_changes_with_the_layout():
    assert Path(layout.__file__) in ubep.native.HEADERS


def test_every_name_cpp_uses_is_one_the_python_side_makes():
    """What C++ writes or reads under `layout.NAMES` is what Python's own constructors
    (`ubep.handle.new_*`, `DeferredStats.of`) write, the torch backend's dispatch state's
    slots, or its scratch buffers' keys."""
    import numpy as np
    import torch

    idx, w = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1)
    h = new_handle(0, 1, 1, 0, 4, idx, w, np.zeros((3, 0), np.int64), None)
    r = new_dispatch_result(torch.zeros(0, 4), np.zeros(0, np.float32), np.zeros(1, np.int64),
                            h, None)
    made = {*h.__dict__, *r.__dict__, *new_combine_result(torch.zeros(1, 4), None).__dict__,
            *DeferredStats.of(print).__dict__}
    scratch = {"send", "recv", "csend", "combine"}      # `TorchBackend._buffer`'s names
    for name in layout.NAMES:
        assert name in made or name in _TorchState.__slots__ or name in scratch, name
    assert len(set(layout.NAMES)) == len(layout.NAMES)


def test_no_cpp_source_spells_a_python_attribute():
    """Every Python name C++ uses comes from `layout.NAMES`; state moves through shared
    int64 words. (threading.Lock's acquire/release are the one method pair it calls.)"""
    for src in CPP:
        text = src.read_text()
        assert not re.search(r'(GetAttr|SetAttr)String|CallMethod\(', text), src.name
        for m in re.finditer(r'(PyObject_GetAttr|PyObject_SetAttr|get_int)\(\s*[\w.()]+,'
                             r'\s*([^,)]+)', text):
            arg = m.group(2).strip()        # `get_int(o, name, ...)` passes its name on
            assert arg.startswith("names[N_") or (src.name, arg) == ("native.h", "name"), (
                src.name, m.group(0))
        literals = set(re.findall(r'PyUnicode_InternFromString\("(\w+)"\)', text))
        assert literals <= {"acquire", "release"}, (src.name, literals)
