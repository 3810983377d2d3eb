"""Compile every ubep.gpu kernel for a CUDA target (sm_90) with no GPU; print what the PTX holds.

Run by test_compile.py in a fresh interpreter with TRITON_INTERPRET=0 (the interpreter
accepts programs that the compiler rejects). Arguments are typed by name; pointers and the
row width carry the 16-divisibility Triton's launcher gives torch tensors and H = 7168.
Prints one JSON line per kernel: counts of PTX instructions, and each load of the Triton IR
(TTIR) with the kernel argument its pointer derives from and its cache modifier (PTX has
lost the arguments' names; TTIR still has them).
"""

import json
import os
import re

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ubep.gpu import kernels as K  # noqa: E402

KERNELS = ("ubep_dispatch", "ubep_combine", "bsp_counts", "bsp_send", "bsp_offsets",
           "bsp_reorder", "bsp_send_back", "bsp_reduce")
TYPES = {
    **dict.fromkeys("cnt count_dest send_lo send_tok send_slot send_dst send_pos counts "
                    "count_flag win_ts row_flag recv_rank recv_ts tokens_per_expert err state "
                    "topk_idx cflag offsets wbases".split(), "*i32"),
    **dict.fromkeys("w win_w recv_w".split(), "*fp32"),
    **dict.fromkeys("x win recv_x".split(), "*i16"),        # bf16 rows moved as words
    **dict.fromkeys("expert_out cwin y".split(), "*bf16"),
    **dict.fromkeys("P E EL T K R NC H C S RV max_spins out_stride".split(), "i32"),
}
# the benchmark's P = 32 tiles; then the launcher's specializations of ints equal to 1
# (batch 1, one program per role, top-1, ...), which turn them into compile-time constants
VARIANTS = {
    "p32": dict(BP=32, BE=8, ROWS=8, BH=2048, BK=8, WEIGHTED=True),
    "ones": dict(BP=2, BE=1, ROWS=8, BH=2048, BK=1, WEIGHTED=False, T=1, K=1, EL=1, C=1, S=1,
                 RV=1, R=1, max_spins=1),
}

#: the ops a pointer goes through between a kernel argument and a load (offsets, shapes)
_PTR_OPS = ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape")


def loads_by_argument(ttir: str) -> list[tuple[str | None, str]]:
    """`(argument, cache modifier)` of each `tt.load` in a kernel's TTIR: the argument its
    pointer is computed from (None if not through `_PTR_OPS` alone), modifier "" if none.

    SSA names repeat across sibling regions, so a use is resolved to the nearest earlier
    definition whose region encloses it (by brace depth)."""
    lines = ttir.splitlines()
    start = next(i for i, line in enumerate(lines) if "tt.func public" in line)
    args = set(re.findall(r"%(\w+): ", lines[start]))
    depth, d, defs = [], 0, {}
    for i, line in enumerate(lines):
        depth.append(d)
        m = re.match(r"\s*%(\w+)(?::\d+)? = ([\w.]+) (.*)$", line)
        if m and i > start:
            defs.setdefault(m.group(1), []).append(
                (i, m.group(2), re.findall(r"%(\w+)", m.group(3))))
        code = re.sub(r'"[^"]*"', "", line)
        d += code.count("{") - code.count("}")

    def resolve(name, at):
        for i, op, operands in reversed(defs.get(name, [])):
            if i < at and min(depth[i + 1:at + 1]) >= depth[i]:
                return i, op, operands
        return None

    out = []
    for ds in defs.values():
        for i, op, operands in ds:
            if op != "tt.load":
                continue
            p, at = operands[0], i
            while p is not None and (found := resolve(p, at)) is not None:
                at, p = found[0], found[2][0] if found[1] in _PTR_OPS else None
            cm = re.search(r"cache_modifier = (\w+)", lines[i])
            out.append((p if p in args else None, cm.group(1) if cm else ""))
    return out


for variant, name in [(v, k) for v in VARIANTS for k in KERNELS]:
    CONSTEXPRS = VARIANTS[variant]
    fn = getattr(K, name)
    sig = {a: "constexpr" if a in CONSTEXPRS else TYPES[a] for a in fn.arg_names}
    const = {a: CONSTEXPRS[a] for a in fn.arg_names if a in CONSTEXPRS}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a in ("H", "out_stride")}
    c = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8))
    ptx = c.asm["ptx"]
    print(json.dumps(dict(
        variant=variant, kernel=name, cubin_bytes=len(c.asm["cubin"]),
        vector_ld=bool(re.search(r"ld\.global(\.[a-z0-9]+)*\.v4\.b32", ptx)),
        vector_st=bool(re.search(r"st\.global(\.[a-z0-9]+)*\.v4\.b32", ptx)),
        acquire=len(re.findall(r"atom\.global\.gpu\.acquire\.add", ptx)),
        l1_bypass=bool(re.search(r"ld\.global\.cg\.v4\.b32", ptx)),
        # scalar words read past L1 (counts, weights, (token, slot) words), not row vectors
        cg_words=len(re.findall(r"ld\.global\.cg\.b32", ptx)),
        release=len(re.findall(r"atom\.global\.gpu\.release\.exch", ptx)),
        loads=loads_by_argument(c.asm["ttir"]),
    )))
