"""The loop nest shared by the bfloat16 product kernels (``amx``: AMX tiles;
``avx512_bf16``: AVX-512 BF16 dot products), as LLVM IR text.

Both compute ``C[h] (+)= A1[h] @ B[h] (+ A2[h] @ B[h])`` for h < heads with the same
signature and operand layouts (``amx``'s module docstring); they differ only in how one
32 x 32 block of C is computed, which each passes in.
"""

from __future__ import annotations


def product_ir(symbol: str, declarations: list[str], entry: list[str], column_block: list[str],
               features: str) -> str:
    """The LLVM IR of a product ``symbol`` with ``amx``'s signature (its module
    docstring): the loops over heads, blocks of 32 rows and blocks of 32 columns, shared
    by both engines, around ``column_block``, the IR of one 32 x 32 block of C. That block
    starts at label ``col`` after ``%a1_m`` / ``%a2_m`` (the block's first A rows),
    ``%b_n`` (its first B column pairs) and ``%c_n`` (its first C element) and ends with
    ``br label %col_next``; it may use ``%acc`` (accumulate into C), ``%two`` (A2 given)
    and ``entry``'s values. ``declarations``: the intrinsics it calls; ``features``: the
    target features it needs."""
    ir = ['target triple = "x86_64-unknown-linux-gnu"\n', *declarations,
          f"define void @{symbol}(ptr %a1, ptr %a2, i64 %lda, ptr %b, i64 %ldb, i64 %bstep, "
          "i64 %bcol, ptr %c, i64 %ldc, i64 %m32, i64 %n32, i64 %nk, i64 %heads, i64 %sa, "
          "i64 %sb, i64 %sc, i64 %accumulate) #0 {\n",
          "entry:\n",
          "  %a32 = shl i64 %lda, 5\n  %c32 = shl i64 %ldc, 5\n",
          "  %bcol2 = shl i64 %bcol, 1\n",
          "  %acc = icmp ne i64 %accumulate, 0\n",
          "  %two = icmp ne ptr %a2, null\n",
          *entry,
          "  br label %head\n",
          # for h < heads
          "head:\n",
          "  %h = phi i64 [0, %entry], [%h1, %head_next]\n",
          "  %oa = mul i64 %h, %sa\n  %ob = mul i64 %h, %sb\n  %oc = mul i64 %h, %sc\n",
          "  %a1_h = getelementptr i8, ptr %a1, i64 %oa\n",
          "  %a2_h = getelementptr i8, ptr %a2, i64 %oa\n",
          "  %b_h = getelementptr i8, ptr %b, i64 %ob\n",
          "  %c_h = getelementptr i8, ptr %c, i64 %oc\n",
          "  br label %row\n",
          # for each block of 32 rows
          "row:\n",
          "  %mi = phi i64 [0, %head], [%mi1, %row_next]\n",
          "  %ra = mul i64 %mi, %a32\n  %rc = mul i64 %mi, %c32\n",
          "  %a1_m = getelementptr i8, ptr %a1_h, i64 %ra\n",
          "  %a2_m = getelementptr i8, ptr %a2_h, i64 %ra\n",
          "  %c_m = getelementptr i8, ptr %c_h, i64 %rc\n",
          "  br label %col\n",
          # for each block of 32 columns
          "col:\n",
          "  %ni = phi i64 [0, %row], [%ni1, %col_next]\n",
          "  %nb = shl i64 %ni, 7\n",  # 32 columns: 128 bytes of C's floats
          "  %nbb = mul i64 %ni, %bcol2\n",
          "  %b_n = getelementptr i8, ptr %b_h, i64 %nbb\n",
          "  %c_n = getelementptr i8, ptr %c_m, i64 %nb\n",
          *column_block,
          "col_next:\n",
          "  %ni1 = add i64 %ni, 1\n  %col_done = icmp eq i64 %ni1, %n32\n",
          "  br i1 %col_done, label %row_next, label %col\n",
          "row_next:\n",
          "  %mi1 = add i64 %mi, 1\n  %row_done = icmp eq i64 %mi1, %m32\n",
          "  br i1 %row_done, label %head_next, label %row\n",
          "head_next:\n",
          "  %h1 = add i64 %h, 1\n  %head_done = icmp eq i64 %h1, %heads\n",
          "  br i1 %head_done, label %exit, label %head\n",
          "exit:\n  ret void\n}\n",
          f'attributes #0 = {{ nounwind "target-features"="{features}" }}\n']
    return "".join(ir)
