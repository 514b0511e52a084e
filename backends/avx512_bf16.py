"""bfloat16 matrix products on AVX-512 BF16 dot products (``vdpbf16ps``): the AMX kernel's
product (``amx``) for CPUs that have the dot products but no tiles (AMD Zen 4 and later,
Intel Cooper Lake).

The same product, signature and operand layouts as ``amx.kernel_ir``, so the code that
lays operands out and calls it (``amx_prefill``) runs unchanged on either:

    C[h] (+)= A1[h] @ B[h]  (+ A2[h] @ B[h])      for h < heads

A ``vdpbf16ps`` folds, in each of 16 float32 lanes, one pair of bfloat16 products into
the lane: ``acc[n] += a[2n] b[2n] + a[2n + 1] b[2n + 1]``. B's "VNNI" pairs are exactly
its operand: one pair row of B (two consecutive K values for 16 output columns, 64
bytes) is one vector, and the A pair it meets (two consecutive K values of one A row,
4 bytes) is broadcast to all lanes. A block of 8 rows x 32 columns keeps 16
accumulators in registers over the whole K loop; each pair row of B is loaded once per
block and met by 8 broadcast A pairs (16 dot products per 2 B loads). Each product of
bfloat16 values is exact in float32; the sums are float32, in the hardware's order (the
instruction, like the tiles, treats denormal inputs and results as zero).
"""

from __future__ import annotations

from .product_ir import product_ir

#: Rows of A folded at once (each against two 16-column B vectors: 16 accumulators).
ROWS = 8
_V = "<16 x float>"
_W = "<16 x i32>"
_DOT = "@llvm.x86.avx512bf16.dpbf16ps.512"


def _row_blocks(tag: str, operands: tuple[str, ...]) -> list[str]:
    """The IR of the loop over the 32-row block's ``32 / ROWS`` blocks of ``ROWS`` rows,
    each: C into 16 accumulators (or zeros), the loop over B's pair rows, C stored back.
    Starts in block ``{tag}`` and leaves to block ``col_next``."""
    rows = range(ROWS)
    ir = [f"{tag}:\n",
          f"  %{tag}_blk = phi i64 [0, %col], [%{tag}_blk1, %{tag}_st]\n",
          f"  %{tag}_r0 = mul i64 %{tag}_blk, {ROWS}\n"]
    for i in rows:
        ir += [f"  %{tag}_row{i} = add i64 %{tag}_r0, {i}\n",
               f"  %{tag}_ro{i} = mul i64 %ldc, %{tag}_row{i}\n",
               f"  %{tag}_pc{i}0 = getelementptr i8, ptr %c_n, i64 %{tag}_ro{i}\n",
               f"  %{tag}_pc{i}1 = getelementptr i8, ptr %{tag}_pc{i}0, i64 64\n"]
        for a in operands:
            ir += [f"  %{tag}_ao{a}{i} = mul i64 %lda, %{tag}_row{i}\n",
                   f"  %{tag}_pa{a}{i} = getelementptr i8, ptr %{a}_m, i64 %{tag}_ao{a}{i}\n"]
        for j in (0, 1):
            ir += [f"  %{tag}_l{i}{j} = load {_V}, ptr %{tag}_pc{i}{j}, align 4\n",
                   f"  %{tag}_i{i}{j} = select i1 %acc, {_V} %{tag}_l{i}{j}, {_V} zeroinitializer\n"]
    ir += [f"  br label %{tag}_k\n", f"{tag}_k:\n",
           f"  %{tag}_p = phi i64 [0, %{tag}], [%{tag}_p1, %{tag}_k]\n"]
    for i in rows:
        for j in (0, 1):
            ir.append(f"  %{tag}_c{i}{j} = phi {_V} [%{tag}_i{i}{j}, %{tag}], [%{tag}_n{i}{j}, %{tag}_k]\n")
    # pair row p: K step p / 16 (bstep bytes each), row p % 16 of it (ldb bytes each)
    ir += [f"  %{tag}_ks = lshr i64 %{tag}_p, 4\n",
           f"  %{tag}_kr = and i64 %{tag}_p, 15\n",
           f"  %{tag}_bo1 = mul i64 %{tag}_ks, %bstep\n",
           f"  %{tag}_bo2 = mul i64 %{tag}_kr, %ldb\n",
           f"  %{tag}_bo = add i64 %{tag}_bo1, %{tag}_bo2\n",
           f"  %{tag}_pb0 = getelementptr i8, ptr %b_n, i64 %{tag}_bo\n",
           f"  %{tag}_pb1 = getelementptr i8, ptr %{tag}_pb0, i64 %bcol\n",
           f"  %{tag}_w0 = load {_W}, ptr %{tag}_pb0, align 4\n",
           f"  %{tag}_w1 = load {_W}, ptr %{tag}_pb1, align 4\n",
           f"  %{tag}_b0 = bitcast {_W} %{tag}_w0 to <32 x bfloat>\n",
           f"  %{tag}_b1 = bitcast {_W} %{tag}_w1 to <32 x bfloat>\n",
           f"  %{tag}_ap = shl i64 %{tag}_p, 2\n"]
    for i in rows:
        last = {j: f"%{tag}_c{i}{j}" for j in (0, 1)}
        for x, a in enumerate(operands):
            ir += [f"  %{tag}_q{a}{i} = getelementptr i8, ptr %{tag}_pa{a}{i}, i64 %{tag}_ap\n",
                   f"  %{tag}_s{a}{i} = load i32, ptr %{tag}_q{a}{i}, align 4\n",
                   f"  %{tag}_e{a}{i} = insertelement {_W} poison, i32 %{tag}_s{a}{i}, i64 0\n",
                   f"  %{tag}_v{a}{i} = shufflevector {_W} %{tag}_e{a}{i}, {_W} poison, "
                   "<16 x i32> zeroinitializer\n",
                   f"  %{tag}_x{a}{i} = bitcast {_W} %{tag}_v{a}{i} to <32 x bfloat>\n"]
            for j in (0, 1):
                name = f"%{tag}_n{i}{j}" if x == len(operands) - 1 else f"%{tag}_d{a}{i}{j}"
                ir.append(f"  {name} = call {_V} {_DOT}({_V} {last[j]}, <32 x bfloat> "
                          f"%{tag}_x{a}{i}, <32 x bfloat> %{tag}_b{j})\n")
                last[j] = name
    ir += [f"  %{tag}_p1 = add i64 %{tag}_p, 1\n",
           f"  %{tag}_done = icmp eq i64 %{tag}_p1, %np\n",
           f"  br i1 %{tag}_done, label %{tag}_st, label %{tag}_k\n",
           f"{tag}_st:\n"]
    for i in rows:
        for j in (0, 1):
            ir.append(f"  store {_V} %{tag}_n{i}{j}, ptr %{tag}_pc{i}{j}, align 4\n")
    ir += [f"  %{tag}_blk1 = add i64 %{tag}_blk, 1\n",
           f"  %{tag}_all = icmp eq i64 %{tag}_blk1, {32 // ROWS}\n",
           f"  br i1 %{tag}_all, label %col_next, label %{tag}\n"]
    return ir


def kernel_ir(symbol: str) -> str:
    """The LLVM IR of the product, as a function named ``symbol`` with ``amx.kernel_ir``'s
    parameters (M, N, K in blocks of 32: ``m32``, ``n32``, ``nk``; as there, nk >= 1: an
    empty sum is the caller's)."""
    entry = ["  %np = shl i64 %nk, 4\n"]  # pair rows of B: 16 per K step of 32
    column_block = ["  br i1 %two, label %t, label %o\n"]
    for tag, operands in (("o", ("a1",)), ("t", ("a1", "a2"))):
        column_block += _row_blocks(tag, operands)
    return product_ir(symbol, [f"declare {_V} {_DOT}({_V}, <32 x bfloat>, <32 x bfloat>)\n"],
                      entry, column_block, "+avx512f,+avx512bw,+avx512bf16")
