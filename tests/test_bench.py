"""`gqakv bench` and the asv benchmarks, at tiny sizes: they run, report what they claim,
and their byte counts match the arithmetic. (No timing is asserted: speed targets live
in the benchmarks themselves.)"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from gqakv.tools import bench, cli

ROOT = Path(__file__).resolve().parents[1]
ASV_DIR = ROOT / "asv_benchmarks"
TINY = ["--batch", "3", "--prompt-lens", "5,9", "--chunk", "4", "--steps", "3", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "8", "--no-bandwidth", "--backend", "numpy"]
TOKEN_BYTES = 2 * 2 * 8 * 4  # K and V, 2 KV heads, d = 8, float32


def expected_concat_bytes(prompts, chunk, steps):
    """A concatenation-grown row copies every token it already holds at each append."""
    tokens = 0
    for p in prompts:
        tokens += sum(range(0, p, chunk))  # prefill appends start at 0, chunk, 2 chunk, ...
        tokens += sum(p + s for s in range(steps))  # decode step s starts at p + s
    return tokens * TOKEN_BYTES


def run_cli(capsys, argv):
    assert cli.main(argv) == 0
    return capsys.readouterr()


def test_bench_is_the_default_job_and_reports_every_phase(capsys):
    out = run_cli(capsys, TINY + ["--quiet"]).out  # no subcommand: bench is the default
    for phase in ("prefill append", "prefill attention", "decode append", "decode attention"):
        assert phase in out
    assert "backend: numpy" in out
    assert "GB/s of live K/V" in out
    concat = expected_concat_bytes([5, 9, 5], 4, 3)
    assert concat == (12 + 8 + 66) * TOKEN_BYTES  # worked by hand for prompts 5/9/5
    assert f"would have copied {concat:,} bytes" in out
    # cache: 3 rows x 2 heads x (9 + 3) tokens x 8 x 4 bytes, K and V
    assert "cache: 4.5 KiB allocated once" in out


def test_bench_json_counts(capsys):
    report = json.loads(run_cli(capsys, ["bench", *TINY, "--json"]).out)
    prefill, decode = report["prefill"], report["decode"]
    assert prefill["calls"] == 3 and prefill["tokens"] == 5 + 9 + 5  # ceil(9 / 4) chunks
    assert decode["calls"] == 3 and decode["tokens"] == 3 * 3
    # a decode step reads every row's live K/V once: lens after step s are p + s + 1
    assert decode["kv_bytes_read"] == sum(p + s + 1 for p in (5, 9, 5) for s in range(3)) * TOKEN_BYTES
    assert report["concat_bytes"] == expected_concat_bytes([5, 9, 5], 4, 3)
    assert report["cache_bytes"] == 2 * 3 * 2 * 12 * 8 * 4
    assert report["live_bytes"] == (8 + 12 + 8) * TOKEN_BYTES
    assert report["decode_bytes_per_s"] > 0 and report["read_bandwidth"] is None


QUANT_TOKEN_BYTES = 2 * 2 * (8 + 4)  # K and V, 2 KV heads, 8 one-byte codes + a float32 scale


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("page_size", [None, 4])
def test_bench_kv_dtype_counts_the_bytes_stored(capsys, kv_dtype, page_size):
    """Over a quantized cache every byte count, and so the bandwidth, is of codes + scales."""
    argv = ["bench", *TINY, "--json", "--kv-dtype", kv_dtype]
    if page_size:
        argv += ["--page-size", str(page_size)]
    report = json.loads(run_cli(capsys, argv).out)
    assert report["config"]["kv_dtype"] == kv_dtype
    assert report["token_bytes"] == QUANT_TOKEN_BYTES
    decode = report["decode"]
    assert decode["kv_bytes_read"] == sum(p + s + 1 for p in (5, 9, 5) for s in range(3)) * QUANT_TOKEN_BYTES
    assert report["decode_bytes_per_s"] == decode["kv_bytes_read"] / decode["attention_s"]
    assert report["live_bytes"] == (8 + 12 + 8) * QUANT_TOKEN_BYTES
    assert report["contiguous_bytes"] == 3 * 12 * QUANT_TOKEN_BYTES
    # pages: ceil(8 / 4) + ceil(12 / 4) + ceil(8 / 4) = 7 of 4 slots
    assert report["cache_bytes"] == (3 * 12 if page_size is None else 7 * 4) * QUANT_TOKEN_BYTES
    assert report["concat_bytes"] == expected_concat_bytes([5, 9, 5], 4, 3) // TOKEN_BYTES * QUANT_TOKEN_BYTES


@pytest.mark.parametrize("page_size", [None, 4])
def test_bench_kv_dtype_runs_on_a_quantized_cache(page_size):
    """The workload really stores 8-bit codes and scales, on the CPU default backend too,
    and the reported cache bytes are the allocated store's."""
    for backend in ("numpy", None):
        cfg = bench.Config(batch=3, prompt_lens=(5, 9), chunk=4, steps=2, heads=4, kv_heads=2,
                           head_dim=8, backend=backend, kv_dtype="int8", page_size=page_size)
        res = bench.run_workload(cfg)
        cache = res._cache
        assert cache.kv_dtype == "int8" and cache.store.quantized
        assert str(cache.store.k.dtype) == "int8" and cache.store.k_scale is not None
        assert res.cache_bytes == cache.nbytes
        assert list(cache.host_lens) == [7, 11, 7]


def test_bench_kv_dtype_text_report(capsys):
    out = run_cli(capsys, ["bench", *TINY, "--quiet", "--kv-dtype", "int8"]).out
    assert ("K/V stored as int8 with per-token float32 scales: 48 bytes per token (codes + scales) "
            "against 128 as float32") in out
    assert "allocated once (K and V codes + scales)" in out
    assert "GB/s of live K/V codes + scales" in out


def test_bench_progress_and_bandwidth(capsys, monkeypatch):
    monkeypatch.setattr(bench, "read_bandwidth", lambda: {"numpy_sum_1thread": 1e10, "blas_gemv": 2e10, "best": 2e10})
    captured = run_cli(capsys, ["bench", *[a for a in TINY if a != "--no-bandwidth"]])
    assert "prefill chunks: 3/3" in captured.err and "decode steps: 3/3" in captured.err
    assert "% of the best measured read bandwidth" in captured.out and "of one core" in captured.out


def test_matmul_rate_is_the_flops_of_the_product(monkeypatch):
    """matmul_rate counts 2 n^3 FLOP per product over its best time."""
    times = iter([0.5, 0.25, 0.4])
    monkeypatch.setattr(bench, "_timed", lambda fn: next(times))
    assert bench.matmul_rate(n=64, repeats=3) == 2 * 64 ** 3 / 0.25


def test_bench_prefill_rate_against_the_matmul_rate(capsys, monkeypatch):
    monkeypatch.setattr(bench, "read_bandwidth", lambda: {"numpy_sum_1thread": 1e10, "best": 1e10})
    monkeypatch.setattr(bench, "matmul_rate", lambda: 4e11)
    argv = [a for a in TINY if a != "--no-bandwidth"]
    report = json.loads(run_cli(capsys, ["bench", *argv, "--json"]).out)
    assert report["matmul_flops_per_s"] == 4e11
    out = run_cli(capsys, ["bench", *argv, "--quiet"]).out
    assert re.search(r"prefill attention: \d+\.\d GFLOP/s, \d+% of the float32 matmul rate "
                     r"\(400 GFLOP/s, 2,048-square sgemm\)", out), out


def test_read_bandwidth_measures_something():
    bw = bench.read_bandwidth(nbytes=8 << 20, repeats=2)
    assert bw["best"] == max(v for k, v in bw.items() if k != "best") > 1e8


def test_bench_compare_torch(capsys):
    pytest.importorskip("torch")
    out = run_cli(capsys, ["bench", *TINY, "--quiet", "--compare", "torch"]).out
    assert "vs torch SDPA (enable_gqa=True)" in out
    assert "decode step" in out and "4-token chunk" in out and "torch/gqakv" in out


def test_every_compare_ratio_is_peer_time_over_gqakv_time(capsys):
    """One direction for every peer (onnxruntime's is checked in test_bench_compare_onnxruntime):
    the torch ratio is torch time / gqakv time, and the output says which way it reads."""
    pytest.importorskip("torch")
    report = json.loads(run_cli(capsys, ["bench", *TINY, "--compare", "torch", "--json"]).out)
    for name in ("decode", "prefill_chunk"):
        x = report["compare"][name]
        assert x["ratio"] == x["torch_s"] / x["gqakv_s"] > 0
    out = run_cli(capsys, ["bench", *TINY, "--quiet", "--compare", "torch"]).out
    assert "gqakv/torch" not in out
    assert "(ratio: peer time / gqakv time, above 1: gqakv is faster)" in out


def test_compare_torch_without_torch_fails_at_once_with_the_pinned_command(capsys, monkeypatch):
    """As --compare onnxruntime does: one line, exit 2, before any output or work; the pip
    command is the README's exact CPU pin, not an unpinned `pip install torch`."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    ran = []
    monkeypatch.setattr(bench, "run_workload", lambda *a, **k: ran.append(1))
    assert cli.main(["bench", *TINY, "--compare", "torch"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not ran
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqakv: error: --compare torch needs torch ("), lines
    assert "pip install torch==2.13.0 (CPU build)" in lines[0]
    assert "`torch==2.13.0`\n(CPU build" in (ROOT / "README.md").read_text()  # the same pin


def test_bench_json_threads_is_a_number_and_device_is_its_own_field(capsys):
    for backend in ("numpy", "numba"):
        if backend == "numba":
            pytest.importorskip("numba")
        argv = [a if a != "numpy" else backend for a in TINY]
        report = json.loads(run_cli(capsys, ["bench", *argv, "--json"]).out)
        assert report["device"] == "cpu"
        assert isinstance(report["threads"], int) and report["threads"] == bench.backend_threads(
            __import__("gqakv").get_backend(backend))
        assert isinstance(report["threads_detail"], str)
        out = run_cli(capsys, ["bench", *argv, "--quiet"]).out
        n = report["threads"]
        assert f"backend: {backend} (cpu, {n} thread{'s' if n != 1 else ''}" in out


def test_torch_sdpa_peer_computes_the_same_attention():
    """The peer the ratios are taken against really is the same attention (ragged rows)."""
    pytest.importorskip("torch")
    import gqakv

    rng = np.random.default_rng(0)
    cache = gqakv.KVCache(2, 2, 16, 8, backend="numpy")
    kv = rng.standard_normal((2, 2, 9, 8), dtype=np.float32)
    cache.append(kv, kv, [9, 6])
    q = rng.standard_normal((2, 4, 3, 8), dtype=np.float32)
    ours = gqakv.gqa_attention(q, cache, [3, 3])
    import torch
    import torch.nn.functional as F

    for b, L in enumerate((9, 6)):
        mask = torch.ones(3, L, dtype=torch.bool).tril(L - 3)
        want = F.scaled_dot_product_attention(torch.from_numpy(q[b:b + 1]),
                                              torch.from_numpy(cache.k[b:b + 1, :, :L]),
                                              torch.from_numpy(cache.v[b:b + 1, :, :L]),
                                              attn_mask=mask, enable_gqa=True)
        np.testing.assert_allclose(ours[b:b + 1], want.numpy(), atol=2e-5)
    assert callable(bench.torch_sdpa(q, cache.k, cache.v, cache.host_lens, [3, 3]))


# -- the ONNX Runtime peer -------------------------------------------------------------------

def _onnxruntime_or_skip():
    try:
        bench.import_onnxruntime()
    except ImportError as exc:
        pytest.skip(f"{exc} (the 'compare' extra is not part of the test extra)")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("B, past, T", [(1, [7], 5), (2, [0, 0], 6)])
def test_onnxruntime_peer_computes_the_same_prefill_chunk(dtype, B, past, T):
    """T > 1 new tokens per row (a chunk over a past at B = 1, whole prompts at B = 2):
    the float64 reference with the bottom-right causal mask, the chunk's K/V written
    from each row's length on, nothing else touched."""
    _onnxruntime_or_skip()
    from tests.support.reference import reference_attention

    rng = np.random.default_rng(1)
    Hq, Hkv, M, d = 4, 2, 16, 8
    past = np.array(past)

    def draw(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    k_buf, v_buf = draw(B, Hkv, M, d), draw(B, Hkv, M, d)
    q, k_new, v_new = draw(B, Hq, T, d), draw(B, Hkv, T, d), draw(B, Hkv, T, d)
    k_before, v_before = k_buf.copy(), v_buf.copy()
    run, out = bench.onnxruntime_gqa(q, k_new, v_new, k_buf, v_buf, past, threads=1)
    run()
    k_rows = [np.concatenate([k_before[b, :, :past[b]], k_new[b]], axis=1) for b in range(B)]
    v_rows = [np.concatenate([v_before[b, :, :past[b]], v_new[b]], axis=1) for b in range(B)]
    want, _ = reference_attention(q, k_rows, v_rows, [T] * B)
    got = np.asarray(out, dtype=np.float64)
    assert out.shape == (B, Hq, T, d) and out.dtype == dtype
    bound = float(np.finfo(dtype).eps) * np.abs(want) + 1e-5
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    for buf, before, new in ((k_buf, k_before, k_new), (v_buf, v_before, v_new)):
        expected = before.copy()
        for b in range(B):
            expected[b, :, past[b]:past[b] + T] = new[b]
        np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_onnxruntime_peer_computes_the_same_decode_step(dtype):
    """The GroupQueryAttention the ratio is taken against is the same decode step: the
    float64 reference over each row's past plus its new token, the new K/V written at
    the row's length in the shared past/present buffer and nothing else touched."""
    _onnxruntime_or_skip()
    from tests.support.reference import reference_attention

    rng = np.random.default_rng(0)
    B, Hq, Hkv, M, d = 3, 4, 2, 12, 8
    past = np.array([0, 5, 11])

    def draw(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    k_buf, v_buf = draw(B, Hkv, M, d), draw(B, Hkv, M, d)
    q, k_new, v_new = draw(B, Hq, 1, d), draw(B, Hkv, 1, d), draw(B, Hkv, 1, d)
    k_before, v_before = k_buf.copy(), v_buf.copy()
    run, out = bench.onnxruntime_gqa(q, k_new, v_new, k_buf, v_buf, past, threads=1)
    run()
    k_rows = [np.concatenate([k_before[b, :, :past[b]], k_new[b]], axis=1) for b in range(B)]
    v_rows = [np.concatenate([v_before[b, :, :past[b]], v_new[b]], axis=1) for b in range(B)]
    want, _ = reference_attention(q, k_rows, v_rows, [1] * B)
    got = np.asarray(out, dtype=np.float64)
    assert out.shape == (B, Hq, 1, d) and out.dtype == dtype
    # one rounding to dtype plus float32 accumulation
    bound = float(np.finfo(dtype).eps) * np.abs(want) + 1e-5
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    for buf, before, new in ((k_buf, k_before, k_new), (v_buf, v_before, v_new)):
        expected = before.copy()
        for b in range(B):
            expected[b, :, past[b]] = new[b, :, 0]
        np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("backend_name, dtype", [("numpy", "float32"), ("numba", "float16")])
def test_bench_compare_onnxruntime(capsys, dtype, backend_name):
    _onnxruntime_or_skip()
    if backend_name == "numba":
        pytest.importorskip("numba")
    argv = [a if a != "numpy" else backend_name for a in TINY] + ["--dtype", dtype,
                                                                  "--compare", "onnxruntime"]
    report = json.loads(run_cli(capsys, ["bench", *argv, "--json"]).out)
    x = report["compare"]["decode"]
    assert x["lens"] == [8, 12, 8] and x["dtype"] == dtype
    assert max(x["error_gqakv"], x["error_onnxruntime"]) <= x["tolerance"]
    assert x["ratio"] == x["onnxruntime_s"] / x["gqakv_s"] > 0
    assert x["blocks"]["gqakv"]["blocks"] == x["blocks"]["onnxruntime"]["blocks"] == 5
    assert "onnxruntime" in report["compare"]["onnxruntime"] and report["times"]["compare_s"] > 0
    out = run_cli(capsys, ["bench", *argv, "--quiet"]).out
    assert "vs ONNX Runtime GroupQueryAttention" in out and "outputs agree: max |error| against" in out
    assert "onnxruntime/gqakv" in out and "onnxruntime comparison" in out.strip().splitlines()[-1]
    assert "(ratio: peer time / gqakv time, above 1: gqakv is faster;" in out


def test_decode_reference_is_the_reference():
    """The yardstick of the agreement check: its float64 result is tests/support/reference.py's."""
    from tests.support.reference import reference_attention

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 1, 8), dtype=np.float32).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, 7, 8), dtype=np.float32) for _ in range(2))
    exact, plain = bench.decode_reference(q, k, v, [7, 3])
    want, _ = reference_attention(q, [k[0], k[1, :, :3]], [v[0], v[1, :, :3]], [1, 1])
    np.testing.assert_allclose(exact, want, rtol=1e-12, atol=1e-12)
    err = np.abs(plain - want)
    assert 0 < err.max() <= np.finfo(np.float16).eps * np.abs(want).max()  # rounded to float16


def test_compare_onnxruntime_leaves_the_cache_as_it_was():
    _onnxruntime_or_skip()
    import gqakv

    rng = np.random.default_rng(1)
    cache = gqakv.KVCache(2, 2, 10, 8, backend="numpy")
    kv = rng.standard_normal((2, 2, 6, 8), dtype=np.float32)
    cache.append(kv, kv, [6, 3])
    k_live = [cache.k[b, :, :n].copy() for b, n in enumerate((5, 2))]  # all but the last token
    result = bench.compare_onnxruntime(cache, 4, rounds=1, block_s=0.001)
    assert list(cache.host_lens) == [6, 3] and result["decode"]["lens"] == [6, 3]
    for b, n in enumerate((5, 2)):
        np.testing.assert_array_equal(cache.k[b, :, :n], k_live[b])


def test_compare_onnxruntime_refuses_to_time_different_outputs(monkeypatch):
    """A peer whose output differs (here: one query head's output zeroed) stops the
    comparison before any timing."""
    _onnxruntime_or_skip()
    import gqakv

    real = bench.onnxruntime_gqa

    def wrong(*args, **kwargs):
        run, out = real(*args, **kwargs)

        def broken():
            run()
            out[:, 0] = 0

        return broken, out

    monkeypatch.setattr(bench, "onnxruntime_gqa", wrong)
    monkeypatch.setattr(bench, "alternating_blocks", lambda *a, **k: pytest.fail("timed"))
    cache = gqakv.KVCache(2, 2, 10, 8, backend="numpy")
    kv = np.random.default_rng(2).standard_normal((2, 2, 6, 8), dtype=np.float32)
    cache.append(kv, kv, [6, 3])
    with pytest.raises(ValueError, match="GroupQueryAttention and gqakv disagree on this decode step"):
        bench.compare_onnxruntime(cache, 4)
    # Refused or not, the cache ends as documented: same lengths, earlier tokens untouched.
    assert list(cache.host_lens) == [6, 3]
    for b, n in enumerate((5, 2)):
        np.testing.assert_array_equal(cache.k[b, :, :n], kv[b, :, :n])


@pytest.mark.parametrize("missing", ["onnx", "onnxruntime"])
def test_compare_onnxruntime_missing_names_the_pip_command(capsys, monkeypatch, missing):
    # Whether or not the extra is installed here: the named module fails to import.
    for name in ("onnx", "onnxruntime"):
        if name == missing:
            monkeypatch.setitem(sys.modules, name, None)  # import name -> ImportError
        elif importlib.util.find_spec(name) is None:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))  # present, for the test
    assert cli.main(["bench", *TINY, "--compare", "onnxruntime"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"gqakv: error: --compare onnxruntime needs the onnx and onnxruntime packages "
                            f"({missing} is missing): pip install 'gqakv[compare]'  (or: pip install onnx "
                            "onnxruntime)\n")


def test_alternating_blocks_alternates():
    calls = []
    times = bench.alternating_blocks({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     rounds=3, block_s=0.0)
    # a warm-up call and a timed one (sizing the blocks) each, then 3 rounds of blocks of 1
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert times["a"]["blocks"] == 3 and times["b"]["min_s"] <= times["b"]["median_s"]


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--prompt-lens", "4,x"], "--prompt-lens must be comma-separated ints >= 1, got '4,x'"),
    (["--heads", "6", "--kv-heads", "4"], "--heads=6 must be a multiple of --kv-heads=4"),
    (["--kv-dtype", "int8", "--dtype", "float64"],
     "--kv-dtype int8 needs --dtype float32, float16 or bfloat16, got float64 (the reference "
     "precision is never quantized)"),
    (["--compare", "onnxruntime", "--page-size", "4"],
     "--compare onnxruntime reads a contiguous cache of --dtype values; it cannot run with "
     "--page-size or --kv-dtype"),
    (["--compare", "onnxruntime", "--dtype", "bfloat16"],
     "--compare onnxruntime: onnxruntime's GroupQueryAttention on the CPU takes --dtype float32 or "
     "float16, got bfloat16"),
    (["--kv-dtype", "float8_e4m3fn", "--compare", "torch"],
     "--compare torch reads K/V as float32 values; it cannot run with --kv-dtype float8_e4m3fn "
     "(the cache holds codes and scales)"),
])
def test_bench_rejects_bad_flags(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"gqakv: error: {message}\n" and captured.out == ""


# -- asv ------------------------------------------------------------------------------------

MY_MODULES = ["attention", "append", "generation", "storage"]
# class -> (setup args at tiny sizes, class attributes to shrink)
SMOKE = {
    "Decode": (("numpy", "2x40"), {}),
    "DecodeHalf": (("numpy", "bfloat16"), {"SIZE": (2, 40)}),
    "WindowedDecode": (("numpy",), {"L": 64, "W": 16}),
    "RaggedDecode": (("numpy",), {"LENS": (3, 50)}),
    "DraftTree": (("numba", 8, "float32"), {"PREFIX": 40}),
    "ChunkedPrefill": (("numpy", "4096 in 8"), {"CASES": {"4096 in 8": (4, 16)}}),
    "VsTorch": (("decode 4x4096",), {"CASES": {"decode 4x4096": (2, 40, 1)}}),
    "VsOnnxRuntime": (("4x4096", "float16"), {"CASES": {"4x4096": (2, 40)}}),
    "PrefillVsOnnxRuntime": (("512 onto 3000", "float16"), {"CASES": {"512 onto 3000": (30, 12)}}),
    "TempMemory": (("prefill 512 onto 16000",), {"CASES": {"prefill 512 onto 16000": (1, 40, 8)}}),
    "Append": (("numpy", "ragged chunk 4 rows x <=512"), {}),
    "GenerationLoop": (("numpy", "2x9"), {}),
    "ConcatBaseline": (("2x9",), {}),
    "PagedDecode": (("numpy", "4x4096", 16, "bfloat16"), {"CASES": {"4x4096": (2, 40)}}),
    "PagedFork": (("numpy",), {"L": 40, "ROWS": 3}),
    "QuantizedDecode": (("numpy", "4x4096", "int8"), {"CASES": {"4x4096": (2, 40)}}),
    "StepHostTime": (("numba", "paged 16"), {"LAYERS": 2, "ROUNDS": 1}),
    "MixedBatch": (("numpy",), {"CASE": {"decoders": 3, "chunk": 8, "row_len": 24,
                                         "block_s": 0.001}, "ROUNDS": 1}),
    "SharedPrefix": (("numpy", "8 rows x 1024", "float32"),
                     {"CASES": {"8 rows x 1024": (3, 2048)}, "SUFFIX": 5, "ROUNDS": 1,
                      "BLOCK_S": 0.001}),
    "Bfloat16PrefillTiles": (("512 onto 3000",), {"CASES": {"512 onto 3000": (64, 300)}}),
    "AfterModelMatmul": (("numpy", "2x8"), {"PAUSE_S": 0.0}),
}


# benchmarks whose peer is not in the test extra, or that need hardware (AMX tiles) a
# machine may lack: they skip, with the reason, without it
OPTIONAL_PEERS = {"VsOnnxRuntime", "PrefillVsOnnxRuntime", "Bfloat16PrefillTiles"}


def _benchmark_modules():
    sys.path.insert(0, str(ASV_DIR))
    try:
        return {name: importlib.import_module(f"benchmarks.{name}") for name in MY_MODULES}
    finally:
        sys.path.remove(str(ASV_DIR))


def _classes():
    for mod in _benchmark_modules().values():
        for name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and any(
                    m.startswith(("time_", "peakmem_", "track_")) for m in dir(cls)):
                yield name, cls


def test_every_benchmark_class_has_a_smoke_entry():
    assert sorted(name for name, _ in _classes()) == sorted(SMOKE)


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_runs_at_tiny_size(name, monkeypatch):
    cls = dict(_classes())[name]
    args, shrink = SMOKE[name]
    for attr, value in shrink.items():
        monkeypatch.setattr(cls, attr, value)
    mod = sys.modules[cls.__module__]
    if hasattr(mod, "STEPS"):
        monkeypatch.setattr(mod, "STEPS", 3)
        monkeypatch.setattr(mod, "CHUNK", 4)
    common = sys.modules[cls.__module__.rsplit(".", 1)[0] + ".common"]
    monkeypatch.setattr(common, "_bandwidth", 1e10)
    bench_obj = cls()
    try:
        bench_obj.setup(*args)
    except NotImplementedError as exc:  # asv: skipped; here only for a peer outside the test extra
        if name not in OPTIONAL_PEERS:
            raise
        pytest.skip(str(exc))
    methods = [m for m in dir(cls) if m.startswith(("time_", "peakmem_", "track_"))]
    assert methods
    for m in methods:
        value = getattr(bench_obj, m)(*args)
        if m.startswith("track_"):
            assert isinstance(value, (int, float)) and (value >= 0 or math.isnan(value)), (m, value)
    if name == "ConcatBaseline":
        # prompt 9 in chunks of 4 (appends at 0, 4, 8), then 3 decode steps (at 9, 10, 11)
        token = 2 * 8 * 128 * 4
        assert bench_obj.track_bytes_copied(*args) == 2 * (0 + 4 + 8 + 9 + 10 + 11) * token


def test_asv_prefill_flops_count_visible_pairs():
    """The prefill yardstick's FLOP: 4 x d per (query head, visible key) pair, by a loop."""
    _benchmark_modules()
    common = sys.modules["benchmarks.common"]
    lens, n_new = [5, 9, 4], [3, 1, 4]
    pairs = sum(L - n + t + 1 for L, n in zip(lens, n_new) for t in range(n))
    assert common.prefill_flops(lens, n_new, heads=2) == 4 * common.D * 2 * pairs == 4 * common.D * 2 * (12 + 9 + 10)


def test_unavailable_backend_is_skipped_by_asv_convention():
    mod = _benchmark_modules()["attention"]
    with pytest.raises(NotImplementedError, match="no-such-backend"):
        mod.Decode().setup("no-such-backend", "1x8")


@pytest.mark.skipif(shutil.which("asv") is None and not (Path(sys.executable).parent / "asv").exists(),
                    reason="asv not installed (pip install -e '.[bench]')")
def test_asv_check_discovers_every_benchmark():
    exe = Path(sys.executable).parent / "asv"
    cmd = [str(exe) if exe.exists() else "asv", "check", "--python=same"]
    done = subprocess.run(cmd, cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No problems found" in done.stdout


# -- the README's sample output ----------------------------------------------------------------

README = ROOT / "README.md"


def _labels(text: str) -> list[str]:
    """Each line with its numbers and units replaced: what stays is the labels."""
    out = []
    for line in text.strip("\n").splitlines():
        line = re.sub(r"^backend: \S+ \(.*\)$", "backend: NAME (threads or device)", line)  # the machine
        line = re.sub(r"^(read bandwidth \(reading 256 MiB\)):.*$", r"\1: ...", line)  # 1 worker: fewer
        line = re.sub(r"\d[\d,]*(?:\.\d+)?", "#", line)
        line = re.sub(r"#(?:/#)+", "#", line)  # prompt lists
        line = re.sub(r"\b(?:B|KiB|MiB|GiB|TiB|PiB)\b", "UNIT", line)
        out.append(re.sub(r"\s+", " ", line).strip())
    return out


def test_readme_sample_output_has_the_lines_bench_prints(capsys, monkeypatch):
    """The README's sample is a whole `gqakv bench` output: same lines, same labels, in the
    same order as a real run (small sizes, so only the numbers differ)."""
    text = README.read_text()
    blocks = re.findall(r"```\n(gqakv bench: one attention layer.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README's sample bench output block"
    real_bw = bench.read_bandwidth
    monkeypatch.setattr(bench, "read_bandwidth", lambda: real_bw(nbytes=8 << 20, repeats=1))
    out = run_cli(capsys, ["bench", "--backend", "numpy", "--batch", "2", "--prompt-lens", "40,20",
                           "--chunk", "16", "--steps", "4"]).out
    assert _labels(blocks[0]) == _labels(out)


def test_bench_header_prints_the_chunk_used_and_total_covers_everything(capsys, monkeypatch):
    monkeypatch.setattr(bench, "read_bandwidth", lambda: {"numpy_sum_1thread": 1e10, "best": 1e10})
    argv = [a for a in TINY if a != "--no-bandwidth"]
    argv[argv.index("--chunk") + 1] = "512"  # the longest prompt is 9
    out = run_cli(capsys, ["bench", *argv, "--quiet"]).out
    assert "prefill chunk 9 (--chunk 512 clamped to the longest prompt)," in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"total \d+\.\d s \(the whole command: workload \d+\.\d s, read bandwidth "
                        r"and matmul \d+\.\d s\)", last), last
    report = json.loads(run_cli(capsys, ["bench", *TINY, "--json"]).out)
    t = report["times"]
    assert t["total_s"] >= t["workload_s"] == report["wall_s"] > 0
    assert t["bandwidth_s"] is None and t["compare_s"] is None


def test_bench_host_time_reports_the_host_share(capsys):
    """--host-time: the 32-layer decode step as it is and with the kernels no-op'd; on numba
    the host time is a positive part of the step (a no-op'd kernel cannot cost more than
    the kernel, give or take the rounds' noise); numpy's kernels are its one pass over a
    small batch and its append's moves (``numpy_batch``), so it reports host work too."""
    report = json.loads(run_cli(capsys, ["bench", *TINY, "--json", "--host-time",
                                         "--backend", "numba"]).out)
    for key, evicted in (("host_time", 0), ("host_time_cold", 32 << 20)):
        host = report[key]
        assert (host["layers"], host["batch"], host["kv_heads"], host["group"]) == (32, 8, 8, 4)
        assert host["evict_bytes"] == evicted
        assert 0 < host["host_s"] and 0 < host["step_s"]
        assert host["host_per_layer_us"] == pytest.approx(host["host_s"] / 32 * 1e6)
    text = run_cli(capsys, ["bench", *TINY, "--host-time", "--backend", "numpy"]).out
    assert text.count("host time: 32-layer decode step") == 2 and text.count("us of host work per layer") == 2
    assert "caches cold (32 MiB read before each layer, untimed)" in text
    text = run_cli(capsys, ["bench", *TINY, "--host-time", "--backend", "numpy", "--page-size", "16",
                            "--kv-dtype", "int8"]).out
    assert text.count("16 live tokens, float32, pages of 16, kv_dtype int8") == 2  # as stored
    assert text.count("us of host work per layer") == 2


def test_cold_host_time_leaves_the_sweeps_out():
    """``evict_bytes``: the sweep before each layer is not timed: a no-op'd step over one
    layer costs far less than reading the swept buffer (64 MiB: several ms at any read
    rate this machine has; the host work of one layer is tens of microseconds)."""
    from gqakv import ModelKVCache
    from gqakv.tools.host_time import step_host_time

    backend = ModelKVCache(1, 1, 1, 8, 8, backend="numba").backend
    t = time.perf_counter()
    np.ones((64 << 20) // 8).sum()
    sweep_s = time.perf_counter() - t
    host = step_host_time(backend, layers=1, batch=1, kv_heads=1, group=1, head_dim=8, rounds=3,
                          steps_per_round=1, evict_bytes=64 << 20)  # medians of 3
    assert host["evict_bytes"] == 64 << 20
    assert 0 < host["host_s"] < sweep_s / 4, (host, sweep_s)


def test_bench_mixed_batch_reports_packed_padded_and_separate(capsys, monkeypatch):
    """--mixed-batch (shrunk here): the packed, padded and separate forms of the batch,
    their ratios to the separate calls, and the query bytes (the padded layout's
    ``B x chunk`` slots against the packed ``chunk + decoders``)."""
    from gqakv.tools import bench

    monkeypatch.setattr(bench, "MIXED_BATCH", {"decoders": 3, "chunk": 8, "row_len": 24,
                                               "rounds": 1, "block_s": 0.001})
    report = json.loads(run_cli(capsys, ["bench", *TINY, "--json", "--mixed-batch",
                                         "--backend", "numpy"]).out)
    m = report["mixed_batch"]
    t = m["median_s"]
    assert m["packed_over_separate"] == pytest.approx(t["packed"] / t["separate"])
    assert m["padded_over_separate"] == pytest.approx(t["padded"] / t["separate"])
    hq_d_bytes = 8 * 4 * 64 * 4  # Hkv=8, G=4, d=64, float32
    assert m["query_bytes"] == {"packed": (8 + 3) * hq_d_bytes, "padded": 4 * 8 * hq_d_bytes}
    text = run_cli(capsys, ["bench", *TINY, "--mixed-batch", "--backend", "numpy"]).out
    assert re.search(r"mixed batch: 1 x 8-token chunk \+ 3 decode tokens .* packed [\d.]+ ms = "
                     r"[\d.]+x the separate calls'", text), text


def test_bench_shared_prefix_reports_shared_against_unshared(capsys, monkeypatch):
    """--shared-prefix (shrunk here): rows forked from one prefix against the same rows
    holding copies, one ratio from one run; the shared plan formed its group and both
    outputs agree; bad sizes are usage errors."""
    from gqakv.ops import shared_prefix as sp
    from gqakv.tools import bench

    monkeypatch.setattr(bench, "SHARED_PREFIX_TIMING", {"rounds": 1, "block_s": 0.001})
    n = max(sp.MIN_SHARED_TOKENS, sp.MIN_SAVED_TOKENS // 2)  # 3 rows: 2 x n reads saved
    argv = ["bench", *TINY, "--shared-prefix", str(n), "--shared-rows", "3", "--shared-suffix", "5"]
    s = json.loads(run_cli(capsys, [*argv, "--json"]).out)["shared_prefix"]
    t = s["median_s"]
    assert s["shared_over_unshared"] == pytest.approx(t["shared"] / t["unshared"])
    assert s["decision"] == f"shared prefix: entries [0, 1, 2] share {n} tokens"
    assert s["unshared_decision"].startswith("shared prefix not used")
    assert s["max_abs_diff"] < 1e-5 and (s["rows"], s["suffix"], s["prefix"]) == (3, 5, n)
    assert s["gflop"] == pytest.approx(4 * 4 * 8 * 3 * (n + 6) / 1e9)
    text = run_cli(capsys, argv).out
    assert re.search(rf"shared prefix: 3 rows sharing a {n}-token prefix, 5 tokens of their own, "
                     r"one decode token .* shared [\d.]+ ms = [\d.]+x the unshared copies'", text), text
    for flag, value, want in (("--shared-prefix", "0", "--shared-prefix must be >= 1"),
                              ("--shared-rows", "1", "--shared-rows must be >= 2"),
                              ("--shared-prefix", "20", "would form no group (32 rows share 16 "
                               "tokens of full pages, saving 496 key reads; a group needs 256")):
        extra = ["--shared-prefix", "300"] if flag == "--shared-rows" else []
        assert cli.main(["bench", *TINY, *extra, flag, value]) == 2
        assert want in capsys.readouterr().err
    # refused before the workload runs (it would take minutes at real sizes)
    monkeypatch.setattr(bench, "run_workload", lambda *a, **k: pytest.fail("the workload ran"))
    assert cli.main(["bench", *TINY, "--shared-prefix", "300", "--shared-rows", "2"]) == 2
    assert "saving 288 key reads" in capsys.readouterr().err
