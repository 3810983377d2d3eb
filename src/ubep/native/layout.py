"""Every layout Python and `ubep.native`'s C++ share, defined once: here.

The compiled entries take ints by position: int64 blocks the numba kernels and the C++ side
both read (`ST_*`, `D_*`, `C_*`, `S_*`, `K_*`, `B_*`), the door tuples the paths hand the C++
doors (`DR_*`, `SD_*`, `TD_*`, `TC_*`, `TR_*`), and the state words a `Buffer` and its path
share with their door (`BW_*`, `DW_*`, `SW_*`, `TW_*`): mutable int64 arrays both sides hold,
so no C++ reads or writes a Python attribute. The names C++ needs on the objects it makes or
is handed (results, handles, the torch backend's dispatch state, shared dict keys) are
`NAMES`, handed to the extension when it loads (`N_*` indexes them).

`python -m ubep.native build` writes these as `ubep_layout.h` (`header()`) beside the build,
which the C++ sources include; the build's folder is named by this file's hash too, so a
changed layout never loads a stale build. The Python side imports the names from here.
"""

from __future__ import annotations

import numpy as np

# -- int64 blocks of the shm direct path's compiled entries (`shm/direct/entries.py`) --------
# the path's kept state: one array made once per DirectPath
(ST_BASES, ST_WORLD, ST_DLAY, ST_DLAY_N, ST_RANK, ST_EXPERTS, ST_EL, ST_COUNTS, ST_TAILS,
 ST_GOT, ST_SPINS, ST_POS, ST_HIDDEN, ST_READY, ST_DONE_T, ST_Y, ST_DONE_MINE, ST_DONE_FIRST,
 ST_LUT, ST_BEGIN, ST_ROWS, ST_COMBINE) = range(22)
ST_LEN = 22
# dispatch's block: inputs, then outputs (begin: LEFT, N; rows: N, MISSING)
(D_EPOCH, D_CODE, D_IDX, D_W, D_T, D_K, D_ROFF, D_POS, D_TPE, D_INTS, D_WTS, D_X, D_RB, D_DST,
 D_LEFT, D_N, D_MISSING) = range(17)
D_LEN = 17
# combine's block: inputs, then outputs (LEFT: tokens missing or -(r + 1); WAITING)
(C_EPOCH, C_CODE, C_OFFSET, C_COPY_SRC, C_COPY_N, C_SRC, C_N, C_IDX, C_W, C_T, C_K, C_WEIGHTED,
 C_POS, C_RB, C_ES, C_ECODE, C_Y, C_OUT, C_LEFT, C_WAITING) = range(20)
C_LEN = 20

# -- the one-worker staged path's call block (`shm/staged/entries.py`) ------------------------
# the state's address and the call's inputs, then the outputs
(S_STATE, S_EPOCH, S_ELEM, S_X, S_T, S_RB, S_IDX, S_K, S_W, S_TPE, S_N, S_OUT_X, S_WTS,
 S_INTS, S_SPINS, S_ROWS, S_WEIGHTED, S_ES, S_ECODE, S_LUT, S_NLUT, S_Y, S_HIDDEN, S_CAST,
 S_OUT, S_WORLD, S_EL, S_LEFT, S_SENDS, S_META, S_RECV, S_ROUTED) = range(32)
S_LEN = 32
# how the staged combine leaves its fp32 sums (`shm/staged/kernels.py`): as they are, or rounded
# token by token to 16 bits
CAST_NONE, CAST_16 = 0, 1

# -- the torch backend's compiled blocks (`runtime/torch_entries.py`) -------------------------
# a dispatch shape's block: constants (the backend fills them once), one call's inputs, outputs
(K_ROW_BYTES, K_PER_RANK, K_WORLD, K_ME, K_META_K, K_INLINE, K_HROWS, K_WS, K_WS_LEN, K_SEND,
 K_SEND_BYTES, K_RECV, K_RECV_BYTES, K_BLK_BYTES, K_PAIRS, K_CAP, K_POLL_NS, K_RECV_CAP,
 K_HDR_IN, K_PACK, K_HEADERS, K_COUNTS, K_PHASE2, K_PLAN, K_ROWS, K_IDX, K_W, K_T, K_K, K_X,
 K_X_BYTES, K_WORK_BYTES, K_OUT, K_OUT_BYTES, K_RES, K_RES_LEN, K_GATHER_AT, K_GATHER_LEN,
 K_NUM_BACK, K_SENDS, K_FIRST, K_N_ME, K_GMAX, K_NUM_BAGS, K_SUM_R2, K_SUM_S2, K_NUM_REMOTE,
 K_REMOTE_BAGS, K_NUM_RECV, K_OFFSETS) = range(50)
K_ERR = K_OFFSETS + 8          # after res_offsets' 8 words
# elastic: how often a collective's wait calls the door's `check` once it polled K_POLL_NS
K_CHECK_NS = K_ERR + 1
K_LEN = K_CHECK_NS + 1
# a combine's block: the scratch's addresses (each call), constants, one call's inputs
# (`B_KIND`: the partials' dtype, a `torch_layout.KIND_*` code)
(B_SEND_AT, B_BACK_AT, B_HIDDEN, B_INLINE_BYTES, B_POLL_NS, B_BAGS, B_FINAL, B_KIND, B_OWN_AT,
 B_NRET, B_OWN, B_BACK, B_ROWS, B_NUM_ROWS, B_WEIGHTED, B_W_AT, B_ROWS_AT, B_OFFS_AT,
 B_FIN_ROWS_AT, B_FIN_OFFS_AT, B_NUM_PAIRS, B_NUM_BAGS, B_SENDS, B_NUM_TOKENS, B_J0, B_J1,
 B_DST, B_Y, B_ERR, B_CHECK_NS) = range(30)
B_LEN = 30

# an elastic torch backend's record of the collectives a compiled call ran (what a replay
# after a recovery sends again, `TorchElastic`): their count, then per collective its
# source (REC_SEND: the scratch's "send", REC_HDR: the door's `hdr_send`, REC_CSEND: the
# scratch's "csend"), byte offset, bytes, and then `world` input and `world` output splits
# in bytes (`rec_len`)
(REC_COUNT, REC_FIRST) = range(2)
(REC_SOURCE, REC_AT, REC_BYTES, REC_SPLITS) = range(4)
(REC_SEND, REC_HDR, REC_CSEND) = range(3)
#: collectives a compiled call runs at most (dispatch: phase 1, then phase 2)
REC_MOST = 2


def rec_words(world: int) -> int:
    """Words of one collective's record in a REC block."""
    return REC_SPLITS + 2 * world


def rec_len(world: int) -> int:
    """Length of a REC block for a group of `world` ranks."""
    return REC_FIRST + REC_MOST * rec_words(world)


# -- state words shared with the doors (int64 arrays; the Python paths read them too) ---------
# a Buffer's: whether it takes calls (not closed, not broken), its dispatches so far
(BW_USABLE, BW_CALLS) = range(2)
BW_LEN = 2
# the shm direct path's: its epochs, the latest dispatch (and its rows' dtype code), the
# dispatch whose combine buffer was lent (owned)
(DW_EPOCH, DW_C_EPOCH, DW_LAST_CALL, DW_LAST_CODE, DW_LENT_COMB) = range(5)
DW_LEN = 5
# the staged path's: its dispatch and combine epochs
(SW_D_EPOCH, SW_C_EPOCH) = range(2)
SW_LEN = 2
# the torch backend's: tokens per peer that ride in dispatch's first collective, the largest
# count any rank sent one peer in the latest dispatch, and whether the Buffer's door is shut
# (the hybrid backend shuts it but for a run of small flat calls: it times the others)
(TW_INLINE, TW_GMAX, TW_SHUT) = range(3)
TW_LEN = 3

# -- door tuples: objects first, then ints (`<PREFIX>_INTS` is the first int) -----------------
#: `DirectPath.door` (`native/door.cpp`)
DIRECT_DOOR = ("path_words", "buffer_words", "lock", "cdata", "uses", "views", "codes", "elems",
               "dbuild", "cbuild", "resume", "st", "owned", "buffer_id", "recv_off", "area",
               "base", "comb", "hidden", "experts", "max_tokens", "max_top_k")
#: `SinglePath.door` (`native/staged.cpp`)
STAGED_DOOR = ("path_words", "buffer_words", "lock", "codes", "elems", "dbuild", "cbuild",
               "lend", "resume", "state", "y", "buffer_id", "world", "el", "spins", "min_lent",
               "begin", "rows", "cbegin", "cpoll", "hidden", "experts", "max_tokens",
               "max_top_k")
#: `TorchBackend._dispatch_door`, per row type and inline capacity (`torch_dispatch`)
#: `check`, `rec`: None, or an elastic Buffer's (`TorchElastic.overdue`; a REC_* block)
TORCH_DISPATCH_DOOR = ("k", "ws", "group", "scratch", "hdr_send", "hdr_recv", "words", "state",
                       "build", "build_rows", "coll", "buffer_id", "rank", "bytes", "pool",
                       "check", "rec")
#: `TorchBackend._combine_door` (`torch_combine`)
TORCH_COMBINE_DOOR = ("b", "group", "scratch", "build", "rank", "check", "rec")
#: `TorchBackend.door`: the Buffer-level door's words
TORCH_DOOR = ("words", "buffer_words", "lock", "doors", "state_type", "rest", "buffer_id",
              "hidden", "experts", "max_tokens", "max_top_k")
#: each door tuple's C++ prefix and its first int word
DOORS = {"DR": (DIRECT_DOOR, "st"), "SD": (STAGED_DOOR, "state"),
         "TD": (TORCH_DISPATCH_DOOR, None), "TC": (TORCH_COMBINE_DOOR, None),
         "TR": (TORCH_DOOR, "buffer_id")}

# -- names C++ uses on Python objects, handed to it at load (`set_result_types`) ------------
#: attributes of the results and handles it makes or reads (`ubep.handle`), of the stats it
#: defers (`ubep.stats.DeferredStats`), of the torch backend's dispatch state (`_TorchState`),
#: and the keys of that backend's scratch dict
NAMES = ("buffer_id", "call", "num_tokens", "num_recv", "hidden", "topk_idx", "topk_weights",
         "_origins", "state", "recv_x", "_weights", "_tpe", "handle", "stats", "y", "_pending",
         "at", "sizes", "recv_per_rank", "sent_per_rank", "num_remote_bags", "num_own",
         "num_back", "res", "send", "recv", "csend", "combine")

#: each block's C++ enum: (its name, the prefix of its words)
ENUMS = (("St", "ST_"), ("D", "D_"), ("C", "C_"), ("S", "S_"), ("Cast", "CAST_"), ("K", "K_"),
         ("B", "B_"), ("Bw", "BW_"), ("Dw", "DW_"), ("Sw", "SW_"), ("Tw", "TW_"),
         ("Rec", "REC_"))


def door(fields: tuple[str, ...], **words) -> tuple:
    """The door tuple `fields` names (`DIRECT_DOOR`, ...), from `words` by name: each field
    exactly once, in its order (a TypeError names what is missing or extra)."""
    if words.keys() != set(fields):
        raise TypeError(f"door words: missing {sorted(set(fields) - words.keys())}, "
                        f"extra {sorted(words.keys() - set(fields))}")
    return tuple(words[f] for f in fields)


def block(length: int, words: dict[int, int]) -> np.ndarray:
    """An int64 block of `length` words (`ST_LEN`, `K_LEN`, ...): `words` set, the rest 0."""
    b = np.zeros(length, np.int64)
    for k, v in words.items():
        b[k] = v
    return b


def _words(prefix: str) -> list[tuple[str, int]]:
    g = globals()
    return sorted(((k, v) for k, v in g.items() if k.startswith(prefix) and type(v) is int),
                  key=lambda kv: (kv[1], kv[0] == f"{prefix}LEN"))


def header() -> str:
    """`ubep_layout.h`: the layouts above as C++ enums (generated; never edit the header)."""
    out = ["// generated from ubep/native/layout.py by `python -m ubep.native build`: edit that",
           "#pragma once", "", "#include <cstdint>", "", "namespace ubep_layout {", ""]
    for name, prefix in ENUMS:
        words = ", ".join(f"{k} = {v}" for k, v in _words(prefix))
        out.append(f"enum {name} : int64_t {{ {words} }};")
    for prefix, (fields, first_int) in DOORS.items():
        words = [f"{prefix}_{f.upper()} = {i}" for i, f in enumerate(fields)]
        words.append(f"{prefix}_LEN = {len(fields)}")
        if first_int is not None:
            words.append(f"{prefix}_INTS = {fields.index(first_int)}")
        out.append(f"enum {prefix.capitalize()} : int64_t {{ {', '.join(words)} }};")
    names = ", ".join(f"N_{n.lstrip('_').upper()} = {i}" for i, n in enumerate(NAMES))
    out.append(f"enum Name : int {{ {names}, N_LEN = {len(NAMES)} }};")
    out += ["", "}  // namespace ubep_layout", ""]
    return "\n".join(out)
