"""Acquire/release atomics, a CPU pause hint and raw-address views for Numba kernels.

Numba has no public CPU atomics, and a plain load in a spin loop is hoisted out of the loop
by LLVM (the loop then never exits). These `@intrinsic`s emit LLVM `load atomic ... acquire`
and `store atomic ... release` on naturally aligned int64 words (an under-aligned atomic
becomes a library call that crashes), `atomicrmw add` for counters, and the pause hint as the
LLVM intrinsic `llvm.x86.sse2.pause` (inline asm aborts the process under llvmlite).

Every shared word is addressed by its raw address (segment base + byte offset), so a kernel
takes one int64 array of segment bases instead of a tuple of arrays. Callers guarantee that
an address passed here is 8-byte aligned and inside a mapped segment.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
#: whether LLVM's fp16 conversions are instructions here (x86 with F16C, 64-bit ARM), which
#: loops vectorize; elsewhere they would be calls into a runtime library the JIT may lack
HALF_IN_HARDWARE = (bool(llvm.get_host_cpu_features().get("f16c")) if _IS_X86 else
                    platform.machine().lower() in ("aarch64", "arm64"))


def _ptr(builder, addr):
    return builder.inttoptr(addr, _I64.as_pointer())


def _call_void(builder, name: str) -> None:
    """Call the argument-less, void LLVM intrinsic `name` (e.g. `llvm.x86.sse2.pause`)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                        name)
    builder.call(fn, [])


@intrinsic
def load_acquire(typingctx, addr):
    """`load atomic i64 acquire` from the 8-byte aligned address `addr`."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        return builder.load_atomic(_ptr(builder, a), ordering="acquire", align=8)

    return types.int64(addr), codegen


@intrinsic
def store_release(typingctx, addr, value):
    """`store atomic i64 release` of `value` to the 8-byte aligned address `addr`."""
    if not isinstance(addr, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(v, _ptr(builder, a), ordering="release", align=8)
        return context.get_dummy_value()

    return types.void(addr, value), codegen


@intrinsic
def fetch_add(typingctx, addr, value):
    """`atomicrmw add ... acq_rel` on the int64 at `addr`; returns the previous value."""
    if not isinstance(addr, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", _ptr(builder, a), v, ordering="acq_rel")

    return types.int64(addr, value), codegen


@intrinsic
def fetch_or(typingctx, addr, value):
    """`atomicrmw or ... acq_rel` on the int64 at `addr`; returns the previous value."""
    if not isinstance(addr, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("or", _ptr(builder, a), v, ordering="acq_rel")

    return types.int64(addr, value), codegen


@intrinsic
def cpu_pause(typingctx):
    """The spin-wait hint (`pause` on x86); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _IS_X86:
            _call_void(builder, "llvm.x86.sse2.pause")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def store_fence(typingctx):
    """Every store before it visible before any store after it, string and non-temporal
    stores included: `sfence` on x86 (which does not order those otherwise), a release
    fence elsewhere. Between a payload copied by `memcpy_at` and the flag that guards it."""

    def codegen(context, builder, signature, args):
        if _IS_X86:
            _call_void(builder, "llvm.x86.sse.sfence")
        else:
            builder.fence("release")
        return context.get_dummy_value()

    return types.void(), codegen


def _pointer_intrinsic(name, ptr_t, doc):
    """An intrinsic `name(addr)`: the integer address `addr` as a pointer of type `ptr_t`."""

    def typer(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[0], signature.args[0], types.int64)
            return builder.inttoptr(a, context.get_value_type(ptr_t))

        return ptr_t(addr), codegen

    typer.__doc__ = doc
    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


u8_ptr = _pointer_intrinsic("u8_ptr", types.CPointer(types.uint8),
                            "The raw address as `uint8*` (for carray).")
u16_ptr = _pointer_intrinsic("u16_ptr", types.CPointer(types.uint16),
                             "The raw address as `uint16*`.")
i64_ptr = _pointer_intrinsic("i64_ptr", types.CPointer(types.int64),
                             "The raw address as `int64*`.")
f32_ptr = _pointer_intrinsic("f32_ptr", types.CPointer(types.float32),
                             "The raw address as `float32*`.")
void_ptr = _pointer_intrinsic("void_ptr", types.voidptr,
                              "The raw address as `void*`: for `carray(void_ptr(addr), shape, "
                              "dtype)` of any dtype.")


@intrinsic
def _memcpy(typingctx, dst_addr, src_addr, nbytes):
    """`nbytes` from address `src_addr` to `dst_addr` by libc's memcpy (LLVM's intrinsic)."""
    if not all(isinstance(a, types.Integer) for a in (dst_addr, src_addr, nbytes)):
        return None

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        d, s, n = (context.cast(builder, a, t, types.intp)
                   for a, t in zip(args, signature.args))
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, 1)
        return context.get_dummy_value()

    return types.void(dst_addr, src_addr, nbytes), codegen


#: a copy whose destination lies 1-63 bytes past its source modulo 4 KiB goes in pieces of
#: this many bytes: glibc (< 2.39) copies larger ones with `rep movsb`, which AMD Zen 3 runs
#: ~8x slower at such an offset (a batch-128 dispatch from an `x` 16 bytes before a page
#: boundary: 3.7-5.7 vs 1.0-1.5 ms, benchmarks/scripts/bench_copy_alias.py); pieces below
#: glibc's `rep movsb` threshold (2 KiB at the least) take its vector loop, as fast as one
#: call at any other offset
ALIAS_PIECE = 2048


@njit(nogil=True, cache=True, inline="always")
def memcpy_at(dst_addr, src_addr, nbytes):
    """`nbytes` from address `src_addr` to `dst_addr` by libc's memcpy.

    memcpy's string stores write a cache line without reading it first, where a loop of
    plain stores reads every line it writes to: a batch-128 dispatch of the direct path
    copied ~18% faster. For rows nothing orders (the torch backend's) and for rows guarded
    by a *separate* flag word, stored after a `store_fence` (the direct path's meta words):
    within one string operation stores may become visible out of order, so window blocks,
    whose marker can be the block's own last word, are copied by
    `kernels.records.copy_bytes`. Page-aliased copies go in `ALIAS_PIECE` pieces."""
    d, s, n = np.int64(dst_addr), np.int64(src_addr), np.int64(nbytes)
    a = (d - s) & 4095
    if n <= ALIAS_PIECE or a == 0 or a >= 64:
        _memcpy(d, s, n)
        return
    i = np.int64(0)
    while i < n:
        m = min(np.int64(ALIAS_PIECE), n - i)
        _memcpy(d + i, s + i, m)
        i += m


@intrinsic
def bits_to_f32(typingctx, bits):
    """Reinterpret a uint32 bit pattern as float32 (bf16 -> fp32 is `bits << 16`)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def half_bits_to_f32(typingctx, bits):
    """The fp32 value of the fp16 bit pattern `bits` (LLVM `fpext half`: exact; only where
    `HALF_IN_HARDWARE`)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_bits_to_half(typingctx, bits):
    """The fp32 bit pattern `bits` rounded to fp16 bits (LLVM `fptrunc` to `half`: nearest
    even, overflow to inf; only where `HALF_IN_HARDWARE`)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        h = builder.fptrunc(builder.bitcast(v, ir.FloatType()), ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))

    return types.uint16(bits), codegen


#: Which ordering guarantee the runtime relies on here (see `ubep.runtime.shm.memory_model`).
MEMORY_MODEL = (
    "x86-TSO: stores become visible in program order; a release store of the flag/marker "
    "word written after the payload and an acquire load on the reader side suffice. Window "
    "blocks are copied by our own loops (one string operation's stores may become visible "
    "out of order, and a marker can be the block's last word); the direct path's rows by "
    "memcpy, then sfence, then the row's separate meta word" if _IS_X86 else
    "release/acquire atomics: the payload stores happen-before the flag/marker release store, "
    "which synchronizes with the reader's acquire load")
