"""The tools ask the backend, not its name: a third-party backend's hooks (compile ahead,
forced key splits, thread count, device binding, its declared fast paths) reach
``gqakv selftest``, ``gqakv bench``, ``gqakv.distributed`` and ``gqakv info``."""

from __future__ import annotations

import argparse

import numpy as np

import gqakv
from gqakv.tools import bench, selftest
from gqakv.dispatch.backend import GENERIC, FastPath
from gqakv.distributed import rank_backend
from gqakv_backends.numpy_backend import NumpyBackend

from .support.blas import openblas_pthreads_or_skip


class HookedBackend(NumpyBackend):
    """NumPy arrays under another name, with every tool hook answered by itself."""

    name = "hooked-test"
    priority = -1
    fast_paths = (FastPath("hooked path", "attention", frozenset({"contiguous"}), frozenset({"none"})),)
    calls: list = []

    def compile_kernels(self, dtypes, head_dims):
        return [f"hooked<{d}, {h}>" for d in dtypes for h in head_dims]

    def split_attention(self, dtype):
        def split(q, k, v, rows, lens, n_new, *, scale, return_lse):
            type(self).calls.append("split")
            from gqakv_backends.numpy_attention import attention_numpy

            return attention_numpy(q, k, v, rows, lens, n_new, scale=scale, return_lse=return_lse,
                                   workers=1, min_key_split=8, parallel_min_work=0)
        return split, "hooked splits"

    def thread_count(self):
        return 3

    def threads_line(self):
        return "three hooked threads"

    def for_local_device(self, index):
        type(self).calls.append(("device", index))
        return self

    def thread_note(self):
        return "hooked threads spin"


def test_selftest_bench_and_distributed_use_the_backend_hooks(monkeypatch):
    HookedBackend.calls = []
    backend = gqakv.register_backend(HookedBackend)
    try:
        check = selftest._compile(backend, ["float32", "float64"], quick=True)
        assert check.cases == 2 * len(selftest.HEAD_DIMS[True]) and check.required
        assert selftest._split_attention(backend, "float32")[1] == "hooked splits"
        checks = {f: selftest.Check(f, "float32") for f in ("split+merge", "append")}
        selftest._split(backend, "float32", np.random.default_rng(0), True, checks)
        line = checks["split+merge"]
        assert "split" in HookedBackend.calls and line.cases > 0 and line.worst <= 1
        assert bench.thread_count(backend, "cpu") == 3 and bench.thread_count(backend, "cuda:0") is None
        assert bench.backend_threads(backend) == 3 and bench._threads_line(backend) == "three hooked threads"
        monkeypatch.setenv("LOCAL_RANK", "5")
        assert rank_backend("hooked-test") is backend and ("device", 5) in HookedBackend.calls
    finally:
        gqakv.unregister_backend("hooked-test")


def test_a_backend_without_kernels_says_so_and_declares_no_fast_path():
    """The base class's answers: nothing compiled ahead (not required), no split knob, no
    threads, the same backend for any local device, and every call generic."""
    class Plain(NumpyBackend):
        name = "plain-test"
        fast_paths = ()

        def compile_note(self):
            return None

        def split_attention(self, dtype):
            return gqakv.Backend.split_attention(self, dtype)

        def thread_count(self):
            return None

    plain = Plain()
    check = selftest._compile(plain, ["float32"], quick=True)
    assert not check.required and "nothing to build ahead" in check.note
    assert plain.split_attention("float32")[0] is None
    assert bench.thread_count(plain, "cpu") is None and bench.backend_threads(plain) == 1
    assert plain.for_local_device(3) is plain
    assert gqakv.Backend.route(plain, "attention").impl == GENERIC


def test_info_prints_a_backends_thread_note(capsys):
    """``Backend.thread_note`` reaches ``gqakv info`` under the backend that gives it."""
    gqakv.register_backend(HookedBackend)
    try:
        from gqakv.tools import info

        assert info.run(argparse.Namespace(json=False)) == 0
        lines = capsys.readouterr().out.splitlines()
        # the backend's block: its row, then the indented lines up to the next backend's row
        start = next(i for i, line in enumerate(lines) if line.startswith("  hooked-test "))
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("   ")),
                   len(lines))
        assert any(line.strip() == "note: hooked threads spin" for line in lines[start:end])
    finally:
        gqakv.unregister_backend("hooked-test")


def test_blas_spin_note_follows_openblas_threads_and_its_timeout(monkeypatch):
    """The numpy backend (and numba, its subclass) advise OPENBLAS_THREAD_TIMEOUT exactly
    when NumPy's BLAS is OpenBLAS's pthreads build running more than one thread and the
    variable is unset; one thread, or the variable set, and there is nothing to say."""
    from gqakv_backends.cpu_plan import OPENBLAS_TIMEOUT_ENV, blas_spin_note

    threadpoolctl = openblas_pthreads_or_skip()
    monkeypatch.delenv(OPENBLAS_TIMEOUT_ENV, raising=False)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        note = blas_spin_note()
        assert note is not None and f"{OPENBLAS_TIMEOUT_ENV}=4" in note and "2 threads" in note
        assert NumpyBackend().thread_note() == note
        monkeypatch.setenv(OPENBLAS_TIMEOUT_ENV, "4")
        assert blas_spin_note() is None
        monkeypatch.delenv(OPENBLAS_TIMEOUT_ENV)
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert blas_spin_note() is None
