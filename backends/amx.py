"""bfloat16 matrix products on Intel AMX tiles (``tdpbf16ps``), or AVX-512 BF16 dot products
where there are no tiles, for the BLAS path's prefill.

NumPy has no bfloat16 matmul that runs at hardware speed (OpenBLAS's ``sbgemm`` is not
exported by NumPy's build, and ml_dtypes' matmul is an element loop), so bfloat16
caches were computed in float32 matmuls. CPUs with AMX (Intel Sapphire Rapids and later)
multiply bfloat16 tiles with float32 accumulation at many times the float32 FMA rate:
a ``tdpbf16ps`` folds a 16 x 32 by 32 x 16 product into a 16 x 16 float32 tile.

One kernel is compiled here, from LLVM IR through llvmlite (numba's own compiler: no
extra dependency, nothing built at install time), registered as the process symbol
``gqakv_amx_bf16`` (so numba-compiled code calls it directly, ``amx_prefill``), and
callable from Python through ctypes (``matmul``):

    C[h] (+)= A1[h] @ B[h]  (+ A2[h] @ B[h])      for h < heads

- ``A1``, ``A2``: ``[M, K]`` bfloat16 rows (M a multiple of 32, K of 32), ``lda`` bytes
  apart; ``A2`` optional (null: none). Two A operands let a float32 operand be split into
  bfloat16 high and low parts that share one pass over ``B``.
- ``B``: ``[K / 2, N, 2]`` bfloat16 ("VNNI" pairs: row r holds, for each output column
  n, the B values of rows 2r and 2r + 1 side by side; N a multiple of 32), the layout
  the hardware reads. The kernel finds the tile of K step k and output columns 16j..16j
  + 15 at ``b + k * bstep + j * bcol``, its 16 rows ``ldb`` bytes apart (in rows:
  ``bstep`` = 16 ``ldb``, ``bcol`` = 64).
- ``C``: ``[M, N]`` float32, ``ldc`` bytes apart: overwritten, or accumulated into when
  ``accumulate``.

Blocks of 32 x 32 outputs (four tiles) walk K in steps of 32, two A tiles and two B
tiles per step; each product of bfloat16 values is exact in float32, so the only
rounding is the float32 accumulation (in the hardware's order).

Where the CPU has no tiles but has AVX-512 BF16 dot products (AMD Zen 4 and later),
the same product, signature and layouts are compiled from ``avx512_bf16.kernel_ir``
instead and registered under the same symbol, so its callers run unchanged (``engine``
says which runs). On the 2-core AMD EPYC (2026-12-06) one thread of it ran a
``[512, 128] @ [128, 512]`` product at 209-222 GFLOP/s, against 135-190 for OpenBLAS's
float32 sgemm on both cores.

Availability (``why_not``): x86-64 Linux whose CPU declares ``amx_bf16`` with a kernel
that grants the process AMX's tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), or
declares ``avx512_bf16``; llvmlite able to compile for it; and ``GQAKV_AMX`` not ``0``
(the one switch for both). Valgrind emulates neither, so under it (``gqakv work``) the
path is off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

import numpy as np

from .product_ir import product_ir

#: Rows, keys and d of the products come in multiples of this (a block of 2 x 2 tiles).
TILE_BLOCK = 32
#: Set to 0 to keep the float32 matmuls even where bfloat16 products (AMX or AVX-512 BF16)
#: are available.
ENV_AMX = "GQAKV_AMX"
#: The kernel's name, registered as a process symbol once compiled (``_compile``): the
#: AMX kernel, or where the CPU has no tiles the same product on AVX-512 BF16 dot
#: products (``avx512_bf16``).
SYMBOL = "gqakv_amx_bf16"
#: ``engine``'s answers.
AMX_ENGINE = "AMX"
DOT_ENGINE = "AVX-512 BF16"

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64

_TILE = "x86_amx"
_SHAPE = "i16 16, i16 64"  # every tile: 16 rows of 64 bytes


def holds_bfloat16(q) -> bool:
    """Whether ``q`` is float32 holding bfloat16 values only (the low 16 bits of every
    element zero: bfloat16 queries widened by a caller, as the shared-prefix plan's
    parts are), which bfloat16 products (the tiles, ``vdpbf16ps``) multiply exactly as
    they are."""
    return q.dtype == np.float32 and not (q.view(np.uint32) & np.uint32(0xFFFF)).any()


def _load(name: str, ptr: str, stride: str) -> str:
    return f"  %{name} = call {_TILE} @llvm.x86.tileloadd64.internal({_SHAPE}, ptr %{ptr}, i64 %{stride})\n"


def _dot(name: str, acc: str, a: str, b: str) -> str:
    return (f"  %{name} = call {_TILE} @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, "
            f"{_TILE} %{acc}, {_TILE} %{a}, {_TILE} %{b})\n")


def _k_loop(tag: str, operands: tuple[str, ...], entry: str) -> tuple[str, str]:
    """A loop over K steps folding the row tiles of each A operand in ``operands`` into
    the four accumulators entering from block ``entry`` (named ``in_{tag}_{tile}``); the
    step's two B tiles are loaded once for all of them. Returns (IR, its exit block)."""
    tiles = ("00", "01", "10", "11")
    ir = [f"{tag}:\n",
          f"  %{tag}_k = phi i64 [0, %{entry}], [%{tag}_k1, %{tag}]\n"]
    last = {t: f"{tag}_c{t}" for t in tiles}
    ir += [f"  %{tag}_c{t} = phi {_TILE} [%in_{tag}_{t}, %{entry}], [%{tag}_n{t}, %{tag}]\n"
           for t in tiles]
    ir += [f"  %{tag}_ao = shl i64 %{tag}_k, 6\n",
           f"  %{tag}_bo = mul i64 %{tag}_k, %bstep\n",
           f"  %{tag}_pb0 = getelementptr i8, ptr %b_n, i64 %{tag}_bo\n",
           f"  %{tag}_pb1 = getelementptr i8, ptr %{tag}_pb0, i64 %bcol\n",
           _load(f"{tag}_tb0", f"{tag}_pb0", "ldb"), _load(f"{tag}_tb1", f"{tag}_pb1", "ldb")]
    for x, a in enumerate(operands):
        ir += [f"  %{tag}_{a}0 = getelementptr i8, ptr %{a}_m, i64 %{tag}_ao\n",
               f"  %{tag}_{a}1 = getelementptr i8, ptr %{tag}_{a}0, i64 %a16\n",
               _load(f"{tag}_t{a}0", f"{tag}_{a}0", "lda"),
               _load(f"{tag}_t{a}1", f"{tag}_{a}1", "lda")]
        for t in tiles:
            name = f"{tag}_n{t}" if x == len(operands) - 1 else f"{tag}_x{x}_{t}"
            ir.append(_dot(name, last[t], f"{tag}_t{a}{t[0]}", f"{tag}_tb{t[1]}"))
            last[t] = name
    ir += [f"  %{tag}_k1 = add i64 %{tag}_k, 1\n",
           f"  %{tag}_done = icmp eq i64 %{tag}_k1, %nk\n",
           f"  br i1 %{tag}_done, label %{tag}_out, label %{tag}\n",
           f"{tag}_out:\n"]
    return "".join(ir), f"{tag}_out"


def kernel_ir(symbol: str = SYMBOL) -> str:
    """The LLVM IR of the AMX product (the module docstring's), named ``symbol``."""
    tiles = ("00", "01", "10", "11")
    declarations = [
        f"declare {_TILE} @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)\n",
        f"declare {_TILE} @llvm.x86.tdpbf16ps.internal(i16, i16, i16, {_TILE}, {_TILE}, {_TILE})\n",
        f"declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, {_TILE})\n",
        f"declare {_TILE} @llvm.x86.tilezero.internal(i16, i16)\n"]
    entry = ["  %a16 = shl i64 %lda, 4\n", "  %c16 = shl i64 %ldc, 4\n"]
    ir = ["  %pc00 = getelementptr i8, ptr %c_n, i64 0\n",
          "  %pc01 = getelementptr i8, ptr %pc00, i64 64\n",
          "  %pc10 = getelementptr i8, ptr %pc00, i64 %c16\n",
          "  %pc11 = getelementptr i8, ptr %pc10, i64 64\n",
          "  br i1 %acc, label %load_c, label %zero_c\n",
          "load_c:\n"]
    ir += [_load(f"l{t}", f"pc{t}", "ldc") for t in tiles]
    ir += ["  br label %k_pre\n",
           "zero_c:\n"]
    ir += [f"  %z{t} = call {_TILE} @llvm.x86.tilezero.internal({_SHAPE})\n" for t in tiles]
    ir += ["  br label %k_pre\n",
           "k_pre:\n"]
    ir += [f"  %in_{t} = phi {_TILE} [%l{t}, %load_c], [%z{t}, %zero_c]\n" for t in tiles]
    ir += ["  br i1 %two, label %k2_pre, label %k1_pre\n"]
    exits = []
    for tag, operands in (("k1", ("a1",)), ("k2", ("a1", "a2"))):
        ir += [f"{tag}_pre:\n"]
        ir += [f"  %in_{tag}_{t} = phi {_TILE} [%in_{t}, %k_pre]\n" for t in tiles]
        ir += [f"  br label %{tag}\n"]
        body, out = _k_loop(tag, operands, f"{tag}_pre")
        ir += [body, "  br label %store\n"]
        exits.append((tag, out))
    ir += ["store:\n"]
    ir += [f"  %s{t} = phi {_TILE} " + ", ".join(f"[%{tag}_n{t}, %{out}]" for tag, out in exits) + "\n"
           for t in tiles]
    ir += [f"  call void @llvm.x86.tilestored64.internal({_SHAPE}, ptr %pc{t}, i64 %ldc, {_TILE} %s{t})\n"
           for t in tiles]
    ir += ["  br label %col_next\n"]
    return product_ir(symbol, declarations, entry, ir, "+amx-tile,+amx-bf16")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _under_valgrind() -> bool:
    return "vgpreload" in os.environ.get("LD_PRELOAD", "")


@functools.lru_cache(maxsize=None)
def _availability() -> tuple[str | None, str | None]:
    """(the engine that runs the product here, or None; why not, or None)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, ("AMX and AVX-512 BF16 are x86-64 Linux only here "
                      f"(this is {sys.platform} {platform.machine()})")
    flags = _cpu_flags()
    if _under_valgrind():
        return None, "running under valgrind, which emulates neither AMX nor AVX-512 BF16"
    why = []
    if "amx_bf16" in flags:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            why.append(f"the kernel refused AMX tile state (arch_prctl errno {ctypes.get_errno()})")
        else:
            try:
                _compile(AMX_ENGINE)
                return AMX_ENGINE, None
            except Exception as exc:  # llvmlite missing or too old for the AMX intrinsics
                why.append(f"the AMX kernel did not compile ({type(exc).__name__}: {exc})")
    else:
        why.append("the CPU does not declare amx_bf16 (/proc/cpuinfo)")
    if "avx512_bf16" in flags:
        try:
            _compile(DOT_ENGINE)
            return DOT_ENGINE, None
        except Exception as exc:
            why.append(f"the AVX-512 BF16 kernel did not compile ({type(exc).__name__}: {exc})")
    else:
        why.append("nor avx512_bf16")
    return None, ", ".join(why)


def why_not() -> str | None:
    """None where the product can run in this process (on AMX tiles or AVX-512 BF16 dot
    products, ``engine``), else why not (checked once)."""
    if os.environ.get(ENV_AMX, "1").strip() == "0":
        return f"{ENV_AMX}=0"
    return _availability()[1]


def engine() -> str | None:
    """The instructions the product runs on here: ``AMX_ENGINE`` (tiles, preferred),
    ``DOT_ENGINE`` (AVX-512 BF16 dot products), or None (``why_not`` says why)."""
    return None if why_not() else _availability()[0]


_ENGINE: list = []  # keeps the compiled module alive


@functools.lru_cache(maxsize=None)
def _compile(engine_name: str, symbol: str = SYMBOL):
    """Compile the product for ``engine_name`` (``AMX_ENGINE`` or ``DOT_ENGINE``) and
    register it as ``symbol``; returns it callable through ctypes."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if engine_name == AMX_ENGINE:
        source = kernel_ir(symbol)
    else:
        from . import avx512_bf16
        source = avx512_bf16.kernel_ir(symbol)
    module = llvm.parse_assembly(source)
    module.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    _ENGINE.append(engine)
    # numba-compiled code calls it by name (``amx_prefill._kernel``), cached or not
    llvm.add_symbol(symbol, engine.get_function_address(symbol))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    proto = ctypes.CFUNCTYPE(None, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64,
                             i64, i64, i64, i64)
    return proto(engine.get_function_address(symbol))


def matmul(a1, b, c, *, a2=None, accumulate: bool = False, engine_name: str | None = None) -> None:
    """``c[h] (+)= a1[h] @ B[h] (+ a2[h] @ B[h])`` on AMX tiles or AVX-512 BF16 dot
    products (the module docstring; ``engine_name``: one of the two, compiled apart,
    for tests; None: this machine's, ``engine``).

    a1, a2: ``[heads, M, K]`` bfloat16 (or uint16 bits), rows contiguous, the same
    strides; b: B's pairs ``[heads, K / 2, N, 2]`` of the same element size, rows
    contiguous; c: ``[heads, M, N]`` float32, rows contiguous. M, N, K multiples of 32.
    Call only where ``why_not()`` is None."""
    heads, M, K = a1.shape
    N = c.shape[2]
    if (M % 32 or N % 32 or K % 32 or b.shape != (heads, K // 2, N, 2) or c.shape != (heads, M, N)
            or a1.itemsize != 2 or b.itemsize != 2 or c.dtype != np.float32
            or (a2 is not None and (a2.shape != a1.shape or a2.strides != a1.strides))):
        raise ValueError(f"amx.matmul: shapes a {a1.shape}, b {b.shape}, c {c.shape} (M, N, K "
                         "multiples of 32; b [heads, K/2, N, 2]; c float32 [heads, M, N])")
    if not (b.strides[-2:] == (4, 2) and a1.strides[-1] == 2 and c.strides[-1] == 4):
        raise ValueError("amx.matmul: rows must be contiguous")
    if heads == 0 or M == 0 or N == 0:
        return
    if K == 0:  # an empty sum
        if not accumulate:
            c[...] = 0
        return
    # B's tile of K step k, columns 16j..: 16 rows from row 16k, 64 j bytes in
    here = _availability()[0]
    if engine_name in (None, here):
        kernel = _compile(here)
    else:  # the other engine, under a symbol of its own (numba code calls SYMBOL)
        kernel = _compile(engine_name, f"{SYMBOL}_{'amx' if engine_name == AMX_ENGINE else 'dot'}")
    kernel(a1.ctypes.data, None if a2 is None else a2.ctypes.data, a1.strides[1],
           b.ctypes.data, b.strides[1], 16 * b.strides[1], 64, c.ctypes.data, c.strides[1],
           M // 32, N // 32, K // 32, heads, a1.strides[0], b.strides[0], c.strides[0],
           int(accumulate))
