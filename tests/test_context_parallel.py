"""Decode context parallelism (``gqakv.context_parallel``) with real processes on this machine.

One set of 4 gloo processes on 127.0.0.1 (a free port, bounded in time, killed on
failure) runs every multi-process check: CP groups of 2 (ranks 0-1 and 2-3 side by side),
the CP group of all 4, and a TP 2 x CP 2 grid of all 4. Each rank writes what it saw to a
file; the tests compare it with one process of the same model (NumPy, float64):

- greedy generation (chunked ragged prefill, then batched decode) through contiguous,
  paged and int8 caches, with windows (every 2nd layer global), soft-cap and sinks: the
  same tokens, float64 logits within 1e-10. int8 needs a float32 model: its logits
  against one float32 process with an int8 cache are within 4x the float32 model's own
  error against float64 + 1e-6 (each rank quantizes the same tokens with the same
  per-token scales);
- every rank's K/V ``nbytes`` is 1/C of one process's, and a row longer than one
  process's budget fits on every rank;
- a rank raising inside layer 1's attention, or after the last all-gather (in the
  logits), leaves every rank's lengths, pages and live K/V unchanged, and every rank
  raises ContextParallelError naming it; the next step works;
- a rank that dies makes its peer raise ContextParallelError(dead=True) within the
  group's timeout, its cache unchanged.

Without processes: the placement's arithmetic, each rank's attention over its slice
merged over simulated ranks against ``tests/support/reference.py`` (float64 loops), and
the refusals.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from gqakv import ModelKVCache
from gqakv.context_parallel import Interleaved, attend_positions
from gqakv.core.semantics import AttentionParams
from gqakv.ops.merge import apply_sinks, merge_attention
from gqakv_examples.llama import TINY, LlamaModel, generate
from tests.support.ranks import loopback_env, run_group, write_result

F64_ATOL = 1e-10
PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14], [8, 1], [64, 23, 23, 5, 90, 11, 46], [33]]
CHUNKS = [3, 1, 5, 2]
NEW_TOKENS = 6
MAX_LEN = 24  # divisible by chunk x C of every scenario: per-rank bytes exactly 1/C
BIG_LEN = 6144  # likewise: a row one process cannot hold within the simulated budget
WORKER_TIMEOUT_S = 240
DEAD_PEER_TIMEOUT_S = 20
#: Llama-3.1-8B's attention shapes (Hq 32, Hkv 8, d 128) in a model small enough to run here.
LLAMA_HEADS = TINY.replace(n_heads=32, n_kv_heads=8, head_dim=128, hidden_size=64, vocab_size=64)
VARIANT = dict(n_kv_heads=4, sliding_window=4, global_every=2, softcap=3.0, sinks=True)

# name -> (ranks, LlamaConfig changes, cache options, chunk, TP size[, backend])
SCENARIOS = {
    "c2-contiguous": ((0, 1), {}, {}, 2, 1),
    "c2-paged": ((2, 3), {}, {"page_size": 4}, 2, 1),
    "c2-variants": ((0, 1), VARIANT, {}, 3, 1),
    "c2-torch-paged": ((2, 3), VARIANT, {"page_size": 4}, 2, 1, "torch"),
    "c4-contiguous": ((0, 1, 2, 3), {}, {}, 3, 1),
    "c4-variants-paged": ((0, 1, 2, 3), VARIANT, {"page_size": 3}, 2, 1),
    "c4-int8": ((0, 1, 2, 3), VARIANT, {"kv_dtype": "int8"}, 1, 1),
    "tp2xcp2-variants": ((0, 1, 2, 3), VARIANT, {}, 2, 2),
    "tp2xcp2-paged-int8": ((0, 1, 2, 3), VARIANT, {"page_size": 3, "kv_dtype": "int8"}, 2, 2),
}
FAILURE_SCENARIOS = ["c2-contiguous", "c4-variants-paged", "tp2xcp2-variants"]
FAILURES = (("mid-step", 1), ("after-last-gather", 0))  # (where, failing rank of the grid)
OWN_ERROR = {"mid-step": "injected failure in layer 1", "after-last-gather": "injected failure in the logits"}

torch = pytest.importorskip("torch", reason="gqakv.context_parallel needs torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch has no gloo backend", allow_module_level=True)


def _dtype_for(cache_options):
    return "float32" if "kv_dtype" in cache_options else "float64"


# -- what every worker process runs -----------------------------------------------------------


def _snapshot(cache):
    """This rank's lengths (absolute and local), pages held and live K/V bytes."""
    local = cache.local
    kv = []
    for layer in range(local.layers):
        for row in range(local.batch):
            k, v = local.live_kv(layer, row)
            kv.append((local.backend.to_numpy(k).tobytes(), local.backend.to_numpy(v).tobytes()))
    pages = local.pages_used if local.store.kind == "paged" else None
    return cache.host_lens.tolist(), local.host_lens.tolist(), pages, kv


def _failure_checks(cp, model, out, cache_options):
    from gqakv import context_parallel as cpm

    cache = model.new_cache(len(PROMPTS), 16, **cache_options)
    first = np.array([[p[0], p[1] if len(p) > 1 else 0] for p in PROMPTS])
    model.forward(first, [2, 1, 2, 1], cache)
    before = _snapshot(cache)
    step_tokens = np.array([[3, 4], [5, 6], [7, 8], [9, 10]])
    results = {}
    real_attend, real_logits = cpm.ContextParallelStep.attend, model._logits

    def attend_failing_in_layer_1(self, layer, *args, **kwargs):
        if layer == 1:
            raise ValueError("injected failure in layer 1's attention")
        return real_attend(self, layer, *args, **kwargs)

    def logits_failing(*args):
        raise RuntimeError("injected failure in the logits")

    for where, culprit in FAILURES:
        if cp.grid_rank == culprit:
            if where == "mid-step":
                cpm.ContextParallelStep.attend = attend_failing_in_layer_1
            else:
                model._logits = logits_failing
        t0 = time.monotonic()
        try:
            model.forward(step_tokens, [2, 2, 1, 0], cache)
            results[where] = ("no error", None, None, None)
        except cpm.ContextParallelError as exc:
            results[where] = (str(exc), exc.failed_ranks, _snapshot(cache) == before, time.monotonic() - t0)
        finally:
            cpm.ContextParallelStep.attend, model._logits = real_attend, real_logits
        results[where + ": open step"] = cache._open_step is not None
    results["after"] = model.forward(step_tokens, [2, 2, 1, 0], cache)
    results["lens after"] = cache.host_lens.tolist()
    out["failures"] = results


def _dead_peer_check(cp, rank: int, out: dict, outdir: str) -> None:
    from gqakv.context_parallel import ContextParallelError

    model = LlamaModel(TINY, seed=3, dtype="float64", backend="numpy", context_parallel=cp)
    cache = model.new_cache(len(PROMPTS), 16, page_size=4)
    model.forward(np.array([[p[0]] for p in PROMPTS]), [1, 1, 1, 1], cache)
    model.forward(np.array([[p[-1]] for p in PROMPTS]), [1, 1, 1, 1], cache)
    if rank == 3:
        write_result(out, outdir)
        os._exit(0)  # dies without a word to its peer
    before = _snapshot(cache)
    t0 = time.monotonic()
    try:
        model.forward(np.array([[1], [2], [3], [4]]), [1, 1, 1, 1], cache)
        out["dead peer"] = ("no error", None, None, None, None)
    except ContextParallelError as exc:
        out["dead peer"] = (str(exc), time.monotonic() - t0, _snapshot(cache) == before,
                            cache._open_step is None, exc.dead)


def _worker(rank: int, world: int, outdir: str) -> None:
    import datetime

    import torch.distributed as dist

    from gqakv import context_parallel as cpm
    from gqakv import distributed

    out: dict = {"rank": rank}
    try:
        distributed.init(world, timeout_s=60)
        # every rank creates every group, in the same order (torch's rule)
        pairs = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3])}
        tp, grid_cp = cpm.grid(2, 2, chunk=2)
        dying = dist.new_group([2, 3], timeout=datetime.timedelta(seconds=DEAD_PEER_TIMEOUT_S))
        routes = {"kernel": 0, "positions": 0}  # which attention each rank's steps ran
        real_kernel, real_positions = cpm.gqa_attention, cpm.attend_positions

        def spy(route, fn):
            def counted(*args, **kwargs):
                routes[route] += 1
                return fn(*args, **kwargs)
            return counted

        cpm.gqa_attention, cpm.attend_positions = spy("kernel", real_kernel), spy("positions", real_positions)
        for name, (ranks, changes, cache_options, chunk, P, *backend) in SCENARIOS.items():
            if rank not in ranks:
                continue
            routes.update(kernel=0, positions=0)
            if P > 1:  # the grid made above (chunk 2)
                assert chunk == grid_cp.chunk
                cp = grid_cp
            else:
                cp = cpm.ContextParallel(pairs.get(ranks), chunk=chunk)
            model = LlamaModel(TINY.replace(**changes), seed=3, dtype=_dtype_for(cache_options),
                               backend=(backend or ["numpy"])[0], context_parallel=cp)
            assert model.backend.name == (backend or ["numpy"])[0]
            g = generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS, cache_options=cache_options)
            cache = model.new_cache(len(PROMPTS), MAX_LEN, **cache_options)
            big = model.new_cache(1, BIG_LEN, **cache_options)
            out[name] = {"tokens": g.tokens, "logits": g.logits, "cache_nbytes": cache.nbytes,
                         "big_nbytes": big.nbytes, "local_max_len": cache.local.max_len,
                         "cp": (cp.rank, cp.world_size, cp.grid_rank, cp.grid_size),
                         "local_kv_heads": cache.kv_heads, "routes": dict(routes)}
            if name in FAILURE_SCENARIOS:
                _failure_checks(cp, model, out[name], cache_options)
        # A long row: 200 tokens prefilled in chunks of 37 over the 4 ranks, then decoded.
        cp4 = cpm.ContextParallel(None, chunk=5)
        model = LlamaModel(TINY.replace(**VARIANT), seed=3, dtype="float64", backend="numpy",
                           context_parallel=cp4)
        long_prompt = [int(t) for t in np.random.default_rng(7).integers(0, 97, 200)]
        g = generate(model, [long_prompt, [1, 2, 3]], 4, chunks=37, cache_options={"page_size": 8})
        out["long"] = {"tokens": g.tokens, "logits": g.logits, "cache_nbytes": g.cache_nbytes}
        # The collective sizes of one decoded token with Llama-3.1-8B's attention shapes.
        model = LlamaModel(LLAMA_HEADS, seed=1, dtype="float32", backend="numpy", context_parallel=cp4)
        cache = model.new_cache(1, 64)
        model.forward(np.array([[1, 2, 3, 4, 5]]), [5], cache)
        sent, gathered = cp4.bytes_sent, cp4.bytes_gathered
        model.forward(np.array([[6]]), [1], cache)
        out["measured"] = (cp4.bytes_sent - sent, cp4.bytes_gathered - gathered)
        dist.barrier()
        if rank in (2, 3):
            _dead_peer_check(cpm.ContextParallel(dying, chunk=2), rank, out, outdir)
    except BaseException:
        import traceback

        out["error"] = traceback.format_exc()
    write_result(out, outdir)
    os._exit(0)  # no teardown handshake with a peer that is gone


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_group("tests.test_context_parallel", 4, tmp_path_factory.mktemp("cp"), WORKER_TIMEOUT_S)


def _float32_error(changes) -> float:
    got, want = (generate(LlamaModel(TINY.replace(**changes), seed=3, dtype=dtype, backend="numpy"),
                          PROMPTS, NEW_TOKENS, chunks=CHUNKS) for dtype in ("float32", "float64"))
    return float(np.max(np.abs(got.logits - want.logits)))


def _one_process(name):
    _, changes, cache_options = SCENARIOS[name][:3]
    model = LlamaModel(TINY.replace(**changes), seed=3, dtype=_dtype_for(cache_options), backend="numpy")
    return model, generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS, cache_options=cache_options)


# -- the multi-process tests ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_context_parallel_generation_equals_one_process(ranks, name):
    group, changes, cache_options, chunk, P = SCENARIOS[name][:5]
    model, want = _one_process(name)
    assert len(np.unique(want.tokens)) > 4  # a degenerate model would prove little
    C = len(group) // P
    one = model.new_cache(len(PROMPTS), MAX_LEN, **cache_options)
    one_big = model.new_cache(1, BIG_LEN, **cache_options)
    for r in group:
        got = ranks[r][name]
        np.testing.assert_array_equal(got["tokens"], want.tokens)
        if _dtype_for(cache_options) == "float64":
            np.testing.assert_allclose(got["logits"], want.logits, rtol=0, atol=F64_ATOL)
        else:
            err = np.max(np.abs(got["logits"] - want.logits))
            assert err <= 4 * _float32_error(changes) + 1e-6, err
        assert got["cp"][1] == C and got["cp"][3] == len(group)
        # Prefill chunks ran the position-mapped loop, decode steps the backend's kernel (the
        # windowed layers' decode too runs the loop: a window needs the keys' positions).
        layers = model.config.n_layers
        one_token_steps = NEW_TOKENS - 1 + 1  # the decode steps and CHUNKS' chunk of 1
        assert got["routes"]["kernel"] == one_token_steps * (1 if "sliding_window" in changes else layers)
        assert got["routes"]["positions"] > 0
        # Memory: this rank's K/V bytes are 1/(P C) of one process's (TP: its heads).
        assert got["cache_nbytes"] * C * P == one.nbytes, (got["cache_nbytes"], one.nbytes)
        assert got["local_max_len"] == MAX_LEN // C
        assert got["local_kv_heads"] * P == model.config.n_kv_heads
        # A budget one process cannot meet for a BIG_LEN-token row and every rank meets.
        budget = one_big.nbytes // (C * P)
        assert one_big.nbytes > budget and got["big_nbytes"] <= budget


def test_quantized_logits_are_not_those_of_float32(ranks):
    model = LlamaModel(TINY.replace(**VARIANT), seed=3, dtype="float32", backend="numpy")
    plain = generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS)
    assert np.max(np.abs(ranks[0]["c4-int8"]["logits"] - plain.logits)) > 1e-4


def test_a_long_row_equals_one_process(ranks):
    model = LlamaModel(TINY.replace(**VARIANT), seed=3, dtype="float64", backend="numpy")
    long_prompt = [int(t) for t in np.random.default_rng(7).integers(0, 97, 200)]
    want = generate(model, [long_prompt, [1, 2, 3]], 4, chunks=37, cache_options={"page_size": 8})
    budget = want.cache_nbytes // 3  # a device one process's cache outgrows 3 times over
    for r in range(4):
        np.testing.assert_array_equal(ranks[r]["long"]["tokens"], want.tokens)
        np.testing.assert_allclose(ranks[r]["long"]["logits"], want.logits, rtol=0, atol=F64_ATOL)
        assert ranks[r]["long"]["cache_nbytes"] <= budget < want.cache_nbytes


@pytest.mark.parametrize("name", FAILURE_SCENARIOS)
def test_a_failing_rank_aborts_the_step_on_every_rank(ranks, name):
    group = SCENARIOS[name][0]
    for where, culprit in FAILURES:
        for r in group:
            res = ranks[r][name]["failures"]
            message, failed, unchanged, seconds = res[where]
            assert failed == (culprit,), (r, where, message)
            assert f"rank(s) {culprit} raised" in message and "aborted" in message, message
            assert unchanged is True, f"rank {r}: cache changed by the aborted step ({where})"
            assert seconds < 30, seconds  # the flags, not a timeout
            assert res[where + ": open step"] is False
            if ranks[r][name]["cp"][2] == culprit:
                assert OWN_ERROR[where] in message.split("; here: ")[1], message
    model, _ = _one_process(name)
    cache = model.new_cache(len(PROMPTS), 16, **SCENARIOS[name][2])
    first = np.array([[p[0], p[1] if len(p) > 1 else 0] for p in PROMPTS])
    model.forward(first, [2, 1, 2, 1], cache)
    want = model.forward(np.array([[3, 4], [5, 6], [7, 8], [9, 10]]), [2, 2, 1, 0], cache)
    for r in group:
        assert ranks[r][name]["failures"]["lens after"] == cache.host_lens.tolist() == [4, 3, 3, 1]
        np.testing.assert_allclose(ranks[r][name]["failures"]["after"], want, rtol=0, atol=F64_ATOL)


def test_a_dead_rank_makes_its_peer_raise_within_the_timeout(ranks):
    message, seconds, unchanged, closed, dead = ranks[2]["dead peer"]
    assert message != "no error" and seconds is not None, message
    assert seconds < DEAD_PEER_TIMEOUT_S + 10, (seconds, message)
    assert dead is True and "died or stopped answering" in message
    assert "on rank 2 (of the group of ranks [2, 3]): a peer among ranks [3]" in message, message
    assert unchanged is True and closed is True, message


# -- without processes ------------------------------------------------------------------------------


def test_placement_arithmetic():
    for C, S in ((1, 4), (2, 2), (4, 3), (3, 1)):
        owners = [Interleaved.plan(C, r, S) for r in range(C)]
        for L in range(0, 50):
            counts = [int(p.count(L)) for p in owners]
            assert sum(counts) == L and max(counts) - min(counts) <= S  # balanced within a chunk
            for p in owners:
                held = [a for a in range(L) if p.owner(a) == p.rank]
                assert [int(p.absolute(j)) for j in range(len(held))] == held  # local order = absolute
                assert counts[p.rank] <= p.capacity(max(L, 1))
    assert Interleaved.plan(4, 0, 3).capacity(24) == 6 and Interleaved.plan(4, 3, 3).capacity(25) == 9
    with pytest.raises(ValueError, match="rank=2 is out of range for 2 context-parallel ranks"):
        Interleaved.plan(2, 2)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        Interleaved.plan(2, 0, 0)


def _simulated(q, ks, vs, starts, n_new, C, S, params, sinks, kv_dtype=None, page_size=None):
    """Every rank's partial over its slice (``attend_positions``), merged, sinks once."""
    B, Hkv = ks.shape[0], ks.shape[1]
    out = lse = None
    for r in range(C):
        pl = Interleaved.plan(C, r, S)
        cache = ModelKVCache(1, B, Hkv, pl.capacity(ks.shape[2]), ks.shape[3], q.dtype.name, "numpy",
                             kv_dtype=kv_dtype, page_size=page_size)
        lens = starts + n_new
        local = [np.flatnonzero(pl.owner(np.arange(int(lens[b]))) == r) for b in range(B)]
        n_loc = np.array([a.size for a in local])
        T = max(1, int(n_loc.max()))
        k_loc = np.zeros((B, Hkv, T, ks.shape[3]), dtype=q.dtype)
        v_loc = np.zeros_like(k_loc)
        for b in range(B):
            k_loc[b, :, :n_loc[b]] = ks[b][:, local[b]]
            v_loc[b, :, :n_loc[b]] = vs[b][:, local[b]]
        with cache.step(n_loc) as st:
            st.write(0, k_loc, v_loc)
            o_r, l_r = attend_positions(q, st.layer(0).store, np.arange(B), starts, n_new, pl, params)
        out, lse = (o_r, l_r) if out is None else merge_attention(out, lse, o_r, l_r)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, np.asarray(sinks, dtype=lse.dtype))
    return out, lse


@pytest.mark.parametrize("C, S", [(2, 2), (4, 3), (3, 1)])
@pytest.mark.parametrize("variant", ["causal", "window+softcap+sinks", "alibi"])
@pytest.mark.parametrize("storage", [{}, {"page_size": 4}, {"kv_dtype": "int8"}])
def test_rank_slices_merge_to_the_float64_reference(C, S, variant, storage):
    """Randomized ragged chunks: C simulated ranks' partials, merged, equal the float64 loop
    reference (quantized: against the reference over the dequantized keys)."""
    from tests.support import reference

    rng = np.random.default_rng(C * 100 + S)
    B, Hq, Hkv, d = 3, 4, 2, 8
    starts = rng.integers(0, 20, B)
    n_new = rng.integers(0, 6, B)
    n_new[0] = max(1, n_new[0])
    L = starts + n_new
    T = int(n_new.max())
    ks = rng.standard_normal((B, Hkv, int(L.max()), d))
    vs = rng.standard_normal((B, Hkv, int(L.max()), d))
    quantized = bool(storage.get("kv_dtype"))
    dtype = np.float32 if quantized else np.float64
    ks, vs = ks.astype(dtype), vs.astype(dtype)
    q = rng.standard_normal((B, Hq, T, d)).astype(dtype)
    kw = {"window": None, "softcap": None, "sinks": None, "alibi": None}
    if variant == "window+softcap+sinks":
        kw.update(window=5, softcap=2.0, sinks=[0.5, -1.0, 2.0, float("-inf")])
    if variant == "alibi":
        kw.update(alibi=[0.5, 0.25, 0.125, 0.0625])
    params = AttentionParams(scale=0.3, window=kw["window"], softcap=kw["softcap"],
                             alibi_slopes=None if kw["alibi"] is None else tuple(kw["alibi"]))
    got, got_lse = _simulated(q, ks, vs, starts, n_new, C, S, params, kw["sinks"],
                     kv_dtype=storage.get("kv_dtype"), page_size=storage.get("page_size"))
    if not quantized:
        k_rows = [ks[b, :, :int(L[b])] for b in range(B)]
        v_rows = [vs[b, :, :int(L[b])] for b in range(B)]
    else:  # the reference sees what the codes decode to; one float32 process bounds the rounding
        one = ModelKVCache(1, B, Hkv, int(L.max()), d, "float32", "numpy", kv_dtype="int8")
        with one.step(L) as st:
            st.write(0, ks, vs)
        k_rows = [one.live_kv(0, b)[0] for b in range(B)]
        v_rows = [one.live_kv(0, b)[1] for b in range(B)]
    want, want_lse = reference.reference_attention(q, k_rows, v_rows, n_new, 0.3, window=kw["window"],
                                                   softcap=kw["softcap"], sinks=kw["sinks"],
                                                   alibi_slopes=kw["alibi"])
    if not quantized:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got_lse, want_lse, rtol=0, atol=1e-12)
        return
    mid = ModelKVCache(1, B, Hkv, int(L.max()), d, "float32", "numpy", kv_dtype="int8")
    with mid.step(starts) as st:
        st.write(0, ks[:, :, :int(starts.max())], vs[:, :, :int(starts.max())])
    with mid.step(n_new) as st:
        k_tail = np.stack([np.pad(ks[b, :, int(starts[b]):int(L[b])], ((0, 0), (0, T - int(n_new[b])), (0, 0)))
                           for b in range(B)])
        v_tail = np.stack([np.pad(vs[b, :, int(starts[b]):int(L[b])], ((0, 0), (0, T - int(n_new[b])), (0, 0)))
                           for b in range(B)])
        o1, l1 = st.attend(0, q, k_tail, v_tail, params=AttentionParams(
            scale=0.3, window=kw["window"], softcap=kw["softcap"],
            sinks=None if kw["sinks"] is None else tuple(kw["sinks"]),
            alibi_slopes=params.alibi_slopes), return_lse=True)
    err_one = float(np.max(np.abs(o1 - want)))
    err = float(np.max(np.abs(got - want)))
    assert err <= 4 * err_one + 1e-6, (err, err_one)


def test_bad_steps_are_refused_before_anything_is_written():
    from gqakv.context_parallel import ContextParallelCache

    cache = ContextParallelCache(Interleaved.plan(2, 0, 2), 1, 2, 1, 8, 4, "float64", "numpy")
    with pytest.raises(ValueError, match=r"row 1 holds 0 tokens; 9 more exceed max_len=8 "
                                         r"\(absolute tokens per row over 2 context-parallel ranks\)"):
        cache.step([1, 9])
    with pytest.raises(ValueError, match=r"n_new\[0\]=-1 is negative \(row 0\)"):
        cache.step([-1, 1])
    with pytest.raises(ValueError, match=r"rows=\[1, 1\] must be distinct rows of 0..1"):
        cache.step([1, 1], rows=[1, 1])
    with pytest.raises(ValueError, match="tree= .* is not supported under context parallelism"):
        cache.step([1, 1], tree=[[-1], [-1]])
    with pytest.raises(ValueError, match="prefix_cache=True is not supported under context parallelism"):
        ContextParallelCache(Interleaved.plan(2, 0, 2), 1, 2, 1, 8, 4, "float64", "numpy",
                             page_size=4, prefix_cache=True)
    step = cache.step([3, 1])
    with pytest.raises(ValueError, match=r"k_new has shape \[2, 1, 2, 4\]; a context-parallel step "
                                         r"takes padded \[B'=2, H, T >= 3, d\]"):
        step.attend(0, np.zeros((2, 2, 3, 4)), np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 3, 4)),
                    params=AttentionParams(scale=1.0))
    with pytest.raises(ValueError, match="q has head dim d=5, the cache has d=4"):
        step.attend(0, np.zeros((2, 3, 3, 5)), np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4)),
                    params=AttentionParams(scale=1.0))
    with pytest.raises(ValueError, match="window=0 is not allowed: window must be an int >= 1"):
        step.attend(0, np.zeros((2, 2, 3, 4)), np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4)),
                    params=AttentionParams(scale=1.0, window=0))
    assert not step.local._written.any()  # nothing was written by the refused calls
    step.abort()
    assert cache.host_lens.tolist() == [0, 0] and cache.local.host_lens.tolist() == [0, 0]


def test_all_gather_bytes_measured_equal_the_formula(ranks):
    """What the ranks' all-gathers carried for one decoded token (4 ranks, Llama-3.1-8B's
    heads, float32) is what ``context_parallel_traffic`` computes."""
    from gqakv.storage import sizing

    cfg = sizing.ModelConfig("8b-heads", LLAMA_HEADS.n_layers, 32, 8, 128, 0)
    t = sizing.context_parallel_traffic(cfg, 4, context=6, dtype="float32").per_token
    for r in range(4):
        sent, gathered = ranks[r]["measured"]
        assert sent == t["all_gather_send_bytes"] == 2 * (32 * 129 + 1) * 4
        assert gathered - sent == t["all_gather_recv_bytes"]


def test_traffic_numbers_for_llama_31_8b():
    """Per decoded token on one of 8 ranks: 3.5 MiB received against 2 GiB (128k) and
    15.3 GiB (1M tokens) of K/V read."""
    from gqakv.storage import sizing

    for context, local, kv in ((131_072, 16_384, 2 * 2**30), (1_000_000, 125_000, 16_384_000_000)):
        t = sizing.context_parallel_traffic("llama-3.1-8b", 8, context=context)
        assert t.local_tokens == local
        assert t.per_token == {"all_gather_send_bytes": 32 * (32 * 129 + 1) * 4,
                               "all_gather_recv_bytes": 7 * 32 * (32 * 129 + 1) * 4, "kv_read_bytes": kv}
    t = sizing.context_parallel_traffic("llama-3.1-8b", 2, context=1000, tensor_parallel=8)
    assert t.all_gather_send_bytes == (4 * 129 + 1) * 4 and t.kv_read_bytes == 500 * 2 * 1 * 128 * 2


def test_size_command_per_device(capsys):
    from gqakv.tools.cli import main as cli_main

    assert cli_main(["size", "llama-3.1-8b", "--context-parallel", "8", "--max-len", "131072",
                     "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "8 devices per row, interleaved chunks of 16 tokens: each holds 16,384 of a 131,072-token row" in out
    assert "528,512 sent and 3,699,584 (3.5 MiB) received per token over 32 layers" in out
    assert "2,147,483,648 bytes (2.0 GiB) per device to decode one token" in out and "(580x" in out
    assert "cache     : 2,147,483,648 bytes (2.0 GiB)" in out
    assert "largest max_len at batch 1: 5,242,880 tokens" in out  # 8 x 655,360
    assert cli_main(["size", "llama-3.1-8b", "--context-parallel", "8", "--max-len", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "16,384,000,000 bytes (15.3 GiB) per device" in out and "(4,429x the received bytes)" in out
    assert cli_main(["size", "--context-parallel", "0"]) == 2
    assert "--context-parallel must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--context-parallel", "0"], "--context-parallel must be >= 1, got 0"),
    (["--context-parallel", "2", "--cp-chunk", "0"], "--cp-chunk must be >= 1, got 0"),
    (["--context-parallel", "2"], "--context-parallel 2 x --tensor-parallel 1 needs 2 processes started by a "
                                  "launcher, e.g. torchrun --nproc-per-node 2 -m gqakv generate --context-parallel 2"),
    (["--context-parallel", "2", "--tensor-parallel", "3"], "--tensor-parallel 3: world_size=3 cannot split"),
    (["--context-parallel", "2", "--model", "smollm2-135m"], "--context-parallel runs the example model"),
])
def test_generate_refuses_bad_context_parallel_options(capsys, argv, match):
    from gqakv.tools.cli import main as cli_main

    assert cli_main(["generate", "--config", "tiny", *argv]) == 2
    captured = capsys.readouterr()
    assert match in captured.err and captured.out == ""


def test_generate_one_rank_without_a_launcher(capsys):
    from gqakv.tools.cli import main as cli_main

    rc = cli_main(["generate", "--config", "tiny", "--context-parallel", "1", "--dtype", "float64",
                   "--backend", "numpy", "--batch", "2", "--prompt-len", "6", "--new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "context parallel: 1 ranks per row (gloo), interleaved chunks of 16 tokens" in out
    assert "greedy tokens identical: yes" in out
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed beside this Python")
def test_torchrun_generate_command(tmp_path):
    """torchrun --standalone --nproc-per-node 2 -m gqakv generate --context-parallel 2 ..."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gqakv", "generate",
                           "--context-parallel", "2", "--cp-chunk", "3", "--config", "tiny", "--dtype",
                           "float64", "--backend", "numpy", "--batch", "3", "--prompt-len", "13",
                           "--new-tokens", "5", "--chunk", "4", "--page-size", "4", "--window", "5",
                           "--global-every", "2", "--sinks", "--tp-timeout", "60"],
                          cwd=tmp_path, env=loopback_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("gqakv generate: tiny model") == 1  # rank 0 alone prints
    assert "context parallel: 2 ranks per row (gloo), interleaved chunks of 3 tokens; rank 0/2" in out
    assert "greedy tokens identical: yes" in out


def test_grid_refuses_sizes_that_are_not_the_groups():
    import torch.distributed as dist

    from gqakv import context_parallel, distributed

    distributed.init(1)  # a one-process group
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel=2 x context_parallel=2 = 4 ranks, but the "
                                             r"process group has 1"):
            context_parallel.grid(2, 2)
        with pytest.raises(ValueError, match="context_parallel must be >= 1, got 0"):
            context_parallel.grid(1, 0)
        with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
            context_parallel.ContextParallel(None, chunk=0)
        tp, cp = context_parallel.grid(1, 1, chunk=5)
        assert tp is None and (cp.world_size, cp.rank, cp.chunk) == (1, 0, 5)
    finally:
        dist.destroy_process_group()


def test_row_operations_keep_every_rank_in_step():
    """Each simulated rank runs the same row operations on its slice; the slices then hold
    exactly the tokens the placement deals them of the rows the operations made."""
    from gqakv.context_parallel import ContextParallelCache

    C, S, B, L = 3, 2, 3, 17
    rng = np.random.default_rng(5)
    k = rng.standard_normal((B, 1, L, 4))
    caches = [ContextParallelCache(Interleaved.plan(C, r, S), 1, B, 1, 24, 4, "float64", "numpy", page_size=4)
              for r in range(C)]
    lens = np.array([17, 5, 9])
    for cache in caches:
        st = cache.step(lens)
        st.local.write(0, st._mine(k), st._mine(k))
        st.commit()
    for cache in caches:
        cache.reorder([2, 0, 0])
        cache.truncate([1], [11])
        cache.fork(1, [2])
    want_rows = {0: (2, 9), 1: (0, 11), 2: (0, 11)}  # row -> (source row of k, length)
    for cache in caches:
        pl = cache.placement
        assert cache.host_lens.tolist() == [9, 11, 11]
        for row, (src, n) in want_rows.items():
            held = np.flatnonzero(pl.owner(np.arange(n)) == pl.rank)
            np.testing.assert_array_equal(cache.live_kv(0, row)[0], k[src][:, held])
    with pytest.raises(ValueError, match=r"new_lens\[0\]=12 must be within 0..11 \(row 1's length\)"):
        caches[0].truncate([1], [12])


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
