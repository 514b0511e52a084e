"""The kernels' by-value structs are declared once (backends/cupy_backend/structs.py): the
checked-in header is what the declaration generates, the NumPy dtype and the emulator's
ctypes type have one layout, the header's static_asserts stop a compiler that lays a
struct out otherwise, and every kernel takes its family's argument struct (sizes and
padding as documented)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from gqakv_backends.cupy_backend import instantiations as table
from gqakv_backends.cupy_backend import limits, plan, structs

from .cuda_emu import harness


def test_checked_in_header_is_generated():
    """kernels/params.cuh is structs.header_text() (regenerate: python -m
    gqakv_backends.cupy_backend.structs)."""
    assert structs.header_path().read_text(encoding="utf-8") == structs.header_text()


@pytest.mark.parametrize("struct", structs.STRUCTS, ids=lambda s: s.name)
def test_dtype_and_ctypes_share_the_layout(struct):
    ct = struct.ctypes_type()
    dt = struct.dtype
    assert [f[0] for f in ct._fields_] == list(dt.names)
    assert [getattr(ct, name).offset for name in dt.names] == [dt.fields[n][1] for n in dt.names]
    assert __import__("ctypes").sizeof(ct) == dt.itemsize


def test_plan_packs_the_declared_structs():
    assert plan.PARAMS_DTYPE == structs.ATTN_PARAMS.dtype and plan.PAGES_DTYPE == structs.KV_PAGES.dtype
    # the layouts the kernels were written against (a declaration edit shows here)
    assert (plan.PARAMS_DTYPE.itemsize, [plan.PARAMS_DTYPE.fields[n][1] for n in plan.PARAMS_DTYPE.names]) == (
        48, [0, 4, 8, 16, 24, 32, 40])
    assert (plan.PAGES_DTYPE.itemsize, [plan.PAGES_DTYPE.fields[n][1] for n in plan.PAGES_DTYPE.names]) == (
        32, [0, 8, 16, 20, 24])


#: Each argument struct's size and padding (field it precedes, bytes; "" for the end): what
#: the kernels' parameter space holds (4 KB at most), and where the aligned layout has gaps.
ARGS_LAYOUTS = {
    "DecodeArgs": (264, [("keys_per_split", 4)]),
    "PrefillArgs": (240, []),
    "MergeArgs": (128, [("o_sb", 4)]),
    "WriteArgs": (184, []),
    "CopyArgs": (120, [("dst_sl", 4)]),
}


def test_argument_structs_sizes_and_padding():
    by_name = {s.name: s for s in structs.STRUCTS}
    assert {s.name for s in structs.ARGS.values()} == set(ARGS_LAYOUTS)
    for name, (size, gaps) in ARGS_LAYOUTS.items():
        s = by_name[name]
        assert (s.dtype.itemsize, s.padding()) == (size, gaps), name
        assert size <= 4096, f"{name}: {size} bytes do not fit the 4 KB kernel parameter space"
        # pointers and i64 on 8-byte boundaries (the kernels' natural alignment)
        for f in s.fields:
            if isinstance(f.ctype, str) and (f.ctype.endswith("*") or f.ctype == "i64"):
                assert s.dtype.fields[f.name][1] % 8 == 0, (name, f.name)
        # the declaration documents every gap
        decl = s.declaration()
        assert f"// {size} bytes (padding: " in decl
        for field, n in gaps:
            assert (f"({n} bytes of padding: {field} is" in decl) if field else (f"{n} at the end" in decl)


def test_every_kernel_takes_its_family_struct():
    """Each kernel's one parameter is the struct structs.ARGS names for it, and the plans
    pack exactly that struct."""
    assert set(structs.ARGS) == set(table.KERNELS)
    aliases = {"DecodeArgs": "DecodeArgsOf<T>", "PrefillArgs": "PrefillArgsOf<T>"}
    for kernel, struct in structs.ARGS.items():
        text = (structs.header_path().parent / table.KERNELS[kernel].file).read_text(encoding="utf-8")
        m = re.search(rf"\b{kernel}\(\s*const ([^)]*) a\) {{", text)
        assert m, f"{kernel}: no single struct parameter in {table.KERNELS[kernel].file}"
        assert m.group(1).startswith(aliases.get(struct.name, struct.name + "<")), (kernel, m.group(1))
    strides = dict(q_strides=(64,) * 3, buf_strides=(64,) * 3, out_strides=(64,) * 3)
    launches = [*plan.plan_write_kv("bfloat16", 64, np.array([2]), 1, 2, (128,) * 3, (128,) * 3).launches,
                *plan.plan_write_kv("bfloat16", 64, np.array([2]), 1, 2, (128,) * 3, (128,) * 3,
                                    kv_dtype="int8", scale_strides=(2, 2, 1)).launches,
                *plan.plan_copy_tokens("bfloat16", 64, np.array([2]), 1, 1, (128,) * 4, (128,) * 4).launches]
    for t_q, splits in ((1, 2), (9, None)):
        launches += plan.plan_attention("bfloat16", 64, batch=1, kv_heads=1, group=2, t_q=t_q,
                                        lens=np.array([512]), n_new=np.array([t_q]), scale=0.1, sm_count=1,
                                        force_splits=splits, **strides).launches
    assert {launch.kernel for launch in launches} >= {"gqakv_write_kv", "gqakv_write_kv_quantized",
                                                      "gqakv_copy_tokens", "gqakv_merge", "gqakv_decode_mma",
                                                      "gqakv_prefill_mma"}
    for launch in launches:
        (args,) = launch.args
        assert args.struct is structs.ARGS[launch.kernel], launch.name


def _gxx_syntax(text: str, tmp_path) -> subprocess.CompletedProcess:
    (tmp_path / "params.cuh").write_text(text)
    (tmp_path / "t.cpp").write_text('#include "params.cuh"\n')
    return subprocess.run([harness.compiler() or "g++", "-std=c++20", "-fsyntax-only", f"-I{tmp_path}",
                           f"-I{harness.kernel_dir()}", f"-include{harness.HERE / 'cuda_emu.h'}",
                           *limits.define_options(), str(tmp_path / "t.cpp")], capture_output=True, text=True)


def test_header_asserts_the_layout(tmp_path):
    """The generated header compiles; with one offset wrong it stops at its static_assert."""
    if harness.compiler() is None:
        pytest.skip("no C++ compiler (g++)")
    text = structs.header_text()
    assert _gxx_syntax(text, tmp_path).returncode == 0
    bad = text.replace('window) == 8, "', 'window) == 12, "')
    assert bad != text
    r = _gxx_syntax(bad, tmp_path)
    assert r.returncode != 0 and "AttnParams.window: the offset" in r.stderr
    # a template struct's layout is asserted on its all-float instantiation
    bad = text.replace("DecodeArgs<float, float, float>, lse) == 56", "DecodeArgs<float, float, float>, lse) == 64")
    assert bad != text
    r = _gxx_syntax(bad, tmp_path)
    assert r.returncode != 0 and "DecodeArgs.lse: the offset" in r.stderr
