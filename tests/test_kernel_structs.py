"""The kernels' by-value structs are declared once (backends/cupy_backend/structs.py): the
checked-in header is what the declaration generates, the NumPy dtype and the emulator's
ctypes type have one layout, and the header's static_asserts stop a compiler that lays a
struct out otherwise."""

from __future__ import annotations

import subprocess

import pytest

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
        72, [0, 4, 8, 16, 24, 32, 40, 48, 56, 64])
    assert (plan.PAGES_DTYPE.itemsize, [plan.PAGES_DTYPE.fields[n][1] for n in plan.PAGES_DTYPE.names]) == (
        32, [0, 8, 16, 20, 24])


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
