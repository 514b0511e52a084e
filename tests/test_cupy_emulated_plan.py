"""Planned attention on the cupy backend (backends/cupy_backend/work.py), on the CPU emulator.

- a 4-layer step (decode with split-KV, a short chunk with padded queries; contiguous and
  paged) planned once: every layer's result has the bits of the unplanned call and is
  within float32 error of the float64 reference, on the fused kernels only;
- with ``out`` / ``lse_out`` given, a planned layer's attention makes no allocation and no
  host-to-device copy (the stand-in cupy's allocators, ``asarray`` and ``ndarray.set``
  counted) and the kernels use the plan's own workspaces;
- fixed plans (``fixed=True``): the launches (grids, arguments) stay the same across
  steps of other lengths, idle rows included; ``Step.adopt`` / ``update`` rewrite the
  device ints and page table in place; results as unplanned;
- refusals: fixed plans on a backend without them, on packed queries, on the generic
  route, ``update`` of a plan that is not fixed or with another batch size: clear errors,
  nothing changed; buffers the kernels cannot write are filled by a copy.
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv

from gqakv_backends.cupy_backend.work import CupyWork

from .cuda_emu import emulated_backend as emu
from .support.reference import reference_on_buffers
from .support.tolerance import max_error, plain_float32_attention

LAYERS, B, HKV, G, D = 4, 3, 2, 2, 20  # d = 20: contiguous and paged kernels in the emulator
HQ = HKV * G
HISTORY = (260, 40, 150)  # row 0 long enough that the planner splits its keys
MAX_LEN, PAGE = 288, 16

pytestmark = pytest.mark.skipif(emu.harness.compiler() is None, reason="no g++ for the emulator")


def _cache(backend, storage):
    kw = dict(page_size=PAGE) if storage == "paged" else {}
    return gqakv.ModelKVCache(LAYERS, B, HKV, MAX_LEN, D, dtype="float32", backend=backend, **kw)


def _filled(backend, storage, seed, history=HISTORY):
    """A cache whose rows hold ``history`` tokens in every layer, and those K/V on the host."""
    rng = np.random.default_rng(seed)
    cache = _cache(backend, storage)
    t = max(history)
    ks = [rng.standard_normal((B, HKV, t, D)).astype(np.float32) for _ in range(LAYERS)]
    with cache.step(list(history)) as step:
        for l in range(LAYERS):
            x = backend.from_numpy(ks[l], "float32")
            step.write(l, x, x)
    return cache, ks


def _reference(q, before, history, new, n_new, **variant):
    """float64 reference of q over rows holding ``before`` then ``new`` (K = V)."""
    lens = [h + n for h, n in zip(history, n_new)]
    full = np.zeros((B, HKV, max(lens), D))
    for b, (h, n) in enumerate(zip(history, n_new)):
        full[b, :, :h] = before[b, :, :h]
        full[b, :, h:h + n] = new[b, :, :n]
    ref = reference_on_buffers(q, full, full, lens, n_new, **variant)
    rows = [full[b, :, :L] for b, L in enumerate(lens)]
    plain = plain_float32_attention(q, rows, rows, n_new, D ** -0.5, **variant)
    return ref, max_error(plain, ref[0])


class _DeviceTraffic:
    """Every allocation and host<->device copy of the stand-in cupy (its allocators,
    ``asarray``, ``ascontiguousarray``, ``ndarray.set`` and ``ndarray.get``) while ``on``."""

    def __init__(self, monkeypatch, backend):
        self.on, self.calls = False, []
        cp = backend.runtime.cp
        for name in ("empty", "zeros", "full", "asarray", "ascontiguousarray"):
            monkeypatch.setattr(cp, name, self._wrap(name, getattr(cp, name)))
        for name in ("set", "get"):
            monkeypatch.setattr(emu.EmulatedDeviceArray, name,
                                self._wrap(name, getattr(emu.EmulatedDeviceArray, name)))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.on:
                self.calls.append(name)
            return fn(*args, **kwargs)
        return wrapped


class _Counter(_DeviceTraffic):
    """``_DeviceTraffic`` counted during the backend's attention calls only."""

    def __init__(self, monkeypatch, backend):
        super().__init__(monkeypatch, backend)
        attention = backend.attention

        def counted(*args, **kwargs):
            self.on = True
            try:
                return attention(*args, **kwargs)
            finally:
                self.on = False

        monkeypatch.setattr(backend, "attention", counted)


def _garbage(backend, shape):
    return backend.from_numpy(np.full(shape, 7.0, dtype=np.float32), "float32")


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("n_new", [(1, 1, 1), (5, 3, 0)], ids=["decode", "chunk"])
def test_emulated_planned_step_matches_unplanned_and_reference(monkeypatch, storage, n_new):
    backend = emu.kernels_only(monkeypatch, "planned kernels")
    # the emulator's paged kernels at d = 20 are plain causal ones; contiguous: a window too
    variant = {} if storage == "paged" else dict(window=200)
    cache, before = _filled(backend, storage, 11)
    rng = np.random.default_rng(12)
    T = max(n_new)
    qs = [rng.standard_normal((B, HQ, T, D)).astype(np.float32) for _ in range(LAYERS)]
    ks = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(LAYERS)]
    counter = _Counter(monkeypatch, backend)
    workspaces = []
    run = backend._run_plan

    def seen(plan, arrays, *args):
        workspaces.append((arrays.get("lens"), arrays.get("part_o")))
        return run(plan, arrays, *args)

    backend._run_plan = seen
    with cache.step(list(n_new)) as step:
        plan = step.plan_attention(HQ, **variant)
        work = plan.work
        assert isinstance(work, CupyWork) and work.inputs is plan.inputs
        if T == 1:
            assert work.plan.num_splits > 1 and "part_o" in work.arrays  # split-KV + merge
        for l in range(LAYERS):
            q = backend.from_numpy(qs[l], "float32")
            k = backend.from_numpy(ks[l], "float32")
            out, lse_out = _garbage(backend, (B, HQ, T, D)), _garbage(backend, (B, HQ, T))
            counter.calls.clear()
            got = step.attend(l, q, k, k, plan=plan, return_lse=True, out=out, lse_out=lse_out)
            assert counter.calls == [], (l, counter.calls)  # no allocation, no upload
            assert got[0] is out and got[1] is lse_out
            want = backend.attention(q, step.layer(l).store, plan.inputs, plan.params,
                                     return_lse=True)  # unplanned: planned and uploaded here
            for a, b in zip(got, want):
                np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
            (ref, ref_lse), err_plain = _reference(qs[l], before[l], HISTORY, ks[l], n_new,
                                                   **variant)
            assert max_error(backend.to_numpy(out), ref) <= 4 * err_plain + 1e-6, l
            live = np.isfinite(ref_lse)
            np.testing.assert_allclose(backend.to_numpy(lse_out)[live], ref_lse[live], atol=1e-5)
            assert np.all(backend.to_numpy(lse_out)[~live] == -np.inf)
    # the planned launches: those given the work's lens (not the appends', not the unplanned)
    planned = [w for lens, w in workspaces if lens is work.arrays["lens"]]
    assert len(planned) == LAYERS
    if T == 1:
        assert all(w is work.arrays["part_o"] for w in planned)


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
def test_emulated_step_plans_itself_and_allocates_only_outputs(monkeypatch, storage):
    """Step.attend without plan= plans on its first layer; with no out given, each layer
    allocates its out and lse and copies nothing to the device."""
    backend = emu.kernels_only(monkeypatch, "planned kernels")
    cache, before = _filled(backend, storage, 21)
    rng = np.random.default_rng(22)
    counter = _Counter(monkeypatch, backend)
    with cache.step([1, 1, 1]) as step:
        for l in range(LAYERS):
            q = backend.from_numpy(rng.standard_normal((B, HQ, 1, D)), "float32")
            k = backend.from_numpy(rng.standard_normal((B, HKV, 1, D)), "float32")
            counter.calls.clear()
            got = step.attend(l, q, k, k)
            assert sorted(counter.calls) == ["empty", "empty"], counter.calls
            want = backend.attention(q, step.layer(l).store, next(iter(step._plans.values())).inputs,
                                     next(iter(step._plans.values())).params, return_lse=False)
            np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(want))


FIXED_STEPS = {"decode": (1, 3, ([1, 1, 1], [1, 0, 1], [1, 1, 0])),  # T, splits, n_new per step
               "chunk": (5, None, ([5, 3, 0], [2, 5, 1]))}


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", sorted(FIXED_STEPS))
def test_emulated_fixed_plan_keeps_its_launches_across_steps(monkeypatch, storage, shape):
    """A fixed plan made in one step runs later steps of other lengths (an idle row
    among them) after ``Step.adopt``: the same Plan and launches, results as unplanned
    (up to the split layout) and as the reference, no allocation or upload in any run."""
    backend = emu.kernels_only(monkeypatch, "fixed kernels")
    cache, before = _filled(backend, storage, 31)
    rng = np.random.default_rng(32)
    counter = _Counter(monkeypatch, backend)
    history = list(HISTORY)
    plan = None
    T, splits, n_news = FIXED_STEPS[shape]
    for n_new in n_news:
        with cache.step(n_new) as step:
            if plan is None:
                plan = step.plan_attention(HQ, t_q=T, fixed=True, splits=splits)
                launches = [(x.name, x.grid, x.args) for x in plan.work.plan.launches]
                kernel_plan = plan.work.plan
                assert plan.work.plan.num_splits == (splits or 1)
            else:
                counter.calls.clear()
                counter.on = True
                step.adopt(plan)  # writes the device ints in place: one set, no allocation
                counter.on = False
                assert counter.calls == (["set", "set"] if storage == "paged" else ["set"])
            assert plan.work.plan is kernel_plan
            assert [(x.name, x.grid, x.args) for x in kernel_plan.launches] == launches
            for l in range(LAYERS):
                q_host = rng.standard_normal((B, HQ, T, D)).astype(np.float32)
                k_host = rng.standard_normal((B, HKV, T, D)).astype(np.float32)
                q, k = backend.from_numpy(q_host, "float32"), backend.from_numpy(k_host, "float32")
                out, lse_out = _garbage(backend, (B, HQ, T, D)), _garbage(backend, (B, HQ, T))
                counter.calls.clear()
                step.attend(l, q, k, k, plan=plan, out=out, lse_out=lse_out)
                assert counter.calls == [], counter.calls
                want = backend.attention(q, step.layer(l).store, plan.inputs, plan.params,
                                         return_lse=True)
                # not the same bits: the fixed plan cuts keys by the capacity (3 splits of
                # MAX_LEN / 3 keys), the unplanned one by these lengths (the merge order differs)
                np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(want[0]),
                                           rtol=1e-5, atol=1e-6)
                got_lse, want_lse = backend.to_numpy(lse_out), backend.to_numpy(want[1])
                np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
                np.testing.assert_allclose(got_lse[np.isfinite(got_lse)],
                                           want_lse[np.isfinite(want_lse)], rtol=1e-5, atol=1e-6)
                pad = np.arange(T)[None, :] >= np.asarray(n_new)[:, None]  # [B, T]: the fill
                assert np.all(backend.to_numpy(out).transpose(0, 2, 1, 3)[pad] == 0)
                assert np.all(got_lse.transpose(0, 2, 1)[pad] == -np.inf)
                if l == 0:
                    rows = [backend.to_numpy(step.layer(0).live_kv(b)[0]) for b in range(B)]
                    hist = [r.shape[1] - n for r, n in zip(rows, n_new)]
                    full = np.zeros((B, HKV, max(r.shape[1] for r in rows), D))
                    for b, r in enumerate(rows):
                        full[b, :, :r.shape[1]] = r
                    ref, _ = reference_on_buffers(q_host, full, full, [r.shape[1] for r in rows],
                                                  n_new)
                    assert max_error(backend.to_numpy(out), ref) <= 1e-5
                    assert hist == history
        history = [h + n for h, n in zip(history, n_new)]


def test_emulated_refusals_are_clear_and_change_nothing(monkeypatch):
    backend = emu.EmulatedCupyBackend()
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = backend.from_numpy(np.ones((B, HKV, 4, D)), "float32")
    cache.append(x, x, [4, 2, 1])
    with pytest.raises(TypeError, match="splits= applies to fixed plans"):
        gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ, splits=2)
    with pytest.raises(ValueError, match="fixed plans take padded queries"):
        gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ, packed=True, fixed=True)
    with pytest.raises(ValueError, match="splits must be an int >= 1"):
        gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ, fixed=True, splits=0)
    wide = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, dtype="float64",
                         backend=backend)
    with pytest.raises(ValueError, match="no fixed-buffer plan on cupy_emulated: the route is "
                                         "generic array-API"):
        gqakv.plan_attention(wide, [0, 0, 0], q_heads=HQ, fixed=True)
    numpy_cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend="numpy")
    with pytest.raises(ValueError, match="backend 'numpy' has no fixed-buffer attention plans"):
        gqakv.plan_attention(numpy_cache, [0, 0, 0], q_heads=HQ, fixed=True)
    plain = gqakv.plan_attention(cache, [0, 0, 0], q_heads=HQ, t_q=1)
    with pytest.raises(ValueError, match="update takes a fixed plan"):
        plain.update(cache, [0, 0, 0])
    fixed = gqakv.plan_attention(cache, [0, 0, 0], q_heads=HQ, t_q=1, fixed=True)
    ints = fixed.work.ints.get()
    with pytest.raises(ValueError):
        fixed.update(cache, [1, 1])  # another batch size
    with pytest.raises(ValueError):
        fixed.update(cache, [2, 0, 0])  # more queries than the plan's T
    np.testing.assert_array_equal(fixed.work.ints.get(), ints)
    # packed queries route to the generic code on CuPy: no work
    assert gqakv.plan_attention(cache, [0, 1, 0], q_heads=HQ, packed=True).work is None


def test_emulated_buffers_the_kernels_cannot_write_are_filled_by_copy():
    """out sharing q's memory and a strided lse_out: the kernels write their own buffers,
    copied over (the same bits as the direct write)."""
    backend = emu.EmulatedCupyBackend()
    rng = np.random.default_rng(41)
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = backend.from_numpy(rng.standard_normal((B, HKV, 6, D)), "float32")
    cache.append(x, x, [6, 3, 2])
    plan = gqakv.plan_attention(cache, [2, 1, 0], q_heads=HQ, t_q=2)
    q_host = rng.standard_normal((B, HQ, 2, D)).astype(np.float32)
    want = plan.run(backend.from_numpy(q_host, "float32"), cache, return_lse=True)
    q = backend.from_numpy(q_host, "float32")
    wide = backend.from_numpy(np.full((B, HQ, 2, 2), 7.0), "float32")
    got = plan.run(q, cache, return_lse=True, out=q, lse_out=wide[..., 0])
    assert got[0] is q
    for a, b in zip(got, want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    assert np.all(backend.to_numpy(wide)[..., 1] == 7.0)  # only lse_out's elements written


def test_emulated_plan_of_a_reordered_paged_cache_is_not_used():
    """Same lengths, other pages (a reorder of equally long rows): the planned table is
    stale, so the run uploads the current one (results as unplanned)."""
    backend = emu.EmulatedCupyBackend()
    rng = np.random.default_rng(51)
    cache = gqakv.PagedKVCache(batch=B, kv_heads=HKV, max_len=64, head_dim=D, page_size=8,
                               backend=backend)
    x = backend.from_numpy(rng.standard_normal((B, HKV, 20, D)), "float32")
    cache.append(x, x, [20, 20, 20])
    q = backend.from_numpy(rng.standard_normal((B, HQ, 1, D)), "float32")
    plan = gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ)
    cache.reorder([2, 0, 1])
    assert not np.array_equal(cache.store.page_table.entries,
                              backend.to_numpy(plan.work.arrays["table"]))  # the uploaded one
    got = plan.run(q, cache, return_lse=True)
    want = backend.attention(q, cache.store, plan.inputs, plan.params, return_lse=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))


def test_emulated_plan_on_another_stream_is_not_used(monkeypatch):
    """A plan's uploads were queued on the stream it was made on: a run on another stream
    is computed as an unplanned call (its own uploads; the same bits), a fixed plan's is
    not (its caller orders the streams, as a CUDA graph capture does)."""
    backend = emu.EmulatedCupyBackend()
    rng = np.random.default_rng(61)
    cache = gqakv.KVCache(batch=B, kv_heads=HKV, max_len=32, head_dim=D, backend=backend)
    x = backend.from_numpy(rng.standard_normal((B, HKV, 6, D)), "float32")
    cache.append(x, x, [6, 3, 2])
    q = backend.from_numpy(rng.standard_normal((B, HQ, 1, D)), "float32")
    plan = gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ)
    fixed = gqakv.plan_attention(cache, [1, 1, 1], q_heads=HQ, fixed=True)
    want = plan.run(q, cache, return_lse=True)
    counter = _Counter(monkeypatch, backend)
    monkeypatch.setattr(backend.runtime, "stream_ptr", lambda: 1234)
    got = plan.run(q, cache, return_lse=True)
    assert "asarray" in counter.calls  # uploaded for this stream
    for a, b in zip(got, want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    counter.calls.clear()
    out, lse = _garbage(backend, (B, HQ, 1, D)), _garbage(backend, (B, HQ, 1))
    fixed.run(q, cache, out=out, lse_out=lse)
    assert counter.calls == []


# -- the whole fixed step: append + attention (CUDA graphs) -----------------------------------

class _Graph:
    """A CUDA graph's part as the emulator can play it: while ``capturing``, every device
    operation of the step (the kernel launches with the very arrays they were given, and
    the output pre-fills) is recorded; ``launch()`` replays them in order, as
    ``cupy.cuda.Graph.launch`` would, over the same buffers."""

    def __init__(self, monkeypatch, backend):
        self.capturing, self.ops = False, []
        run, fill = backend._run_plan, emu.EmulatedDeviceArray.fill

        def recorded_run(plan, arrays, *args):
            if self.capturing:
                self.ops.append(lambda: run(plan, arrays, *args))
            return run(plan, arrays, *args)

        def recorded_fill(a, value):
            if self.capturing:
                self.ops.append(lambda: fill(a, value))
            return fill(a, value)

        backend._run_plan = recorded_run
        monkeypatch.setattr(emu.EmulatedDeviceArray, "fill", recorded_fill)

    def launch(self):
        for op in self.ops:
            op()


def _live_rows(cache, l):
    """Layer ``l``'s live K of every row, on the host: [Hkv, L_b, d] each."""
    return [np.asarray(cache.backend.to_numpy(cache.live_kv(l, b)[0])) for b in range(B)]


def _check_reference(out, lse, q_host, rows, n_new):
    """out / lse of queries ``q_host`` against the float64 reference over ``rows`` (each
    row's live K = V after the step), within k x the plain float32 error."""
    lens = [r.shape[1] for r in rows]
    full = np.zeros((B, HKV, max(lens), D))
    for b, r in enumerate(rows):
        full[b, :, :r.shape[1]] = r
    ref, ref_lse = reference_on_buffers(q_host, full, full, lens, n_new)
    plain = plain_float32_attention(q_host, rows, rows, n_new, D ** -0.5)
    assert max_error(out, ref) <= 4 * max_error(plain, ref) + 1e-6
    live = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), live)
    np.testing.assert_allclose(lse[live], ref_lse[live], atol=1e-5)


#: Rows whose steps below cross page boundaries (PAGE = 16: 272, 48, 160), so that a
#: paged step takes new pages and the plan's device table must follow.
WHOLE_HISTORY = (270, 46, 158)
#: Per shape: T and the steps' n_new (idle rows, other lengths each step).
WHOLE_STEPS = {"decode": (1, ([1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1])),
               "chunk": (3, ([3, 1, 0], [2, 3, 1], [1, 0, 3]))}


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", sorted(WHOLE_STEPS))
def test_emulated_fixed_step_is_replayed_bit_for_bit_as_eager(monkeypatch, storage, shape):
    """Batch-invariant mode, 4 layers, several steps of new lengths: a fixed plan made in
    the first step, adopted by the next; in the second step every device operation of the
    step (each layer's fixed append and attention, pre-fills included) is recorded, and
    the later steps only adopt the plan, refill q / K / V's buffers and replay the record
    (``Step.replay``): no allocation and no host<->device copy after ``adopt`` to the end
    of the step, the same append and attention launches in every step, and every layer's
    out and lse the eager step's bits (a second cache stepped with plain ``attend``), its
    cache the same K/V, both within float32 error of the float64 reference."""
    backend = emu.kernels_only(monkeypatch, "fixed kernels")
    fixed_cache, _ = _filled(backend, storage, 71, WHOLE_HISTORY)
    eager_cache, _ = _filled(backend, storage, 71, WHOLE_HISTORY)
    traffic = _DeviceTraffic(monkeypatch, backend)
    launched = []
    run = backend._run_plan

    def seen(plan, arrays, *args):
        launched.append([(x.name, x.grid, x.args, arrays.get("rows")) for x in plan.launches])
        return run(plan, arrays, *args)

    backend._run_plan = seen
    graph = _Graph(monkeypatch, backend)  # its replays go through ``seen`` too
    rng = np.random.default_rng(72)
    T, n_news = WHOLE_STEPS[shape]
    # the graph's inputs and outputs: one buffer each per layer, refilled in place
    qs = [_garbage(backend, (B, HQ, T, D)) for _ in range(LAYERS)]
    ks = [_garbage(backend, (B, HKV, T, D)) for _ in range(LAYERS)]
    outs = [_garbage(backend, (B, HQ, T, D)) for _ in range(LAYERS)]
    lses = [_garbage(backend, (B, HQ, T)) for _ in range(LAYERS)]
    plan, per_step, pages = None, [], []
    with gqakv.batch_invariant():
        for i, n_new in enumerate(n_news):
            q_host = [rng.standard_normal((B, HQ, T, D)).astype(np.float32) for _ in range(LAYERS)]
            k_host = [rng.standard_normal((B, HKV, T, D)).astype(np.float32) for _ in range(LAYERS)]
            for l in range(LAYERS):
                qs[l][...], ks[l][...] = q_host[l], k_host[l]
            launched.clear()
            with fixed_cache.step(n_new) as step:
                if plan is None:
                    plan = step.plan_attention(HQ, t_q=T, fixed=True)
                    assert isinstance(plan.work.append, type(plan.work.plan)), plan.work.append
                else:
                    step.adopt(plan)
                traffic.calls.clear()
                traffic.on = True
                if i < 2:  # eager launches; the second step's recorded as the graph
                    graph.capturing = i == 1
                    for l in range(LAYERS):
                        step.attend(l, qs[l], ks[l], ks[l], plan=plan, out=outs[l],
                                    lse_out=lses[l])
                    graph.capturing = False
                else:
                    step.replay(graph.launch)
            traffic.on = False  # the commit included
            if storage == "paged":
                pages.append(int((fixed_cache.store.page_table.entries >= 0).sum()))
            if i > 0:
                assert traffic.calls == [], traffic.calls
            per_step.append([x[:3] for launches in launched for x in launches])
            # every launch reads the plan's device ints (the appends' too)
            assert all(x[3] is plan.work.arrays["rows"] for launches in launched for x in launches)
            with eager_cache.step(n_new) as step:
                eager = [step.attend(l, backend.from_numpy(q_host[l], "float32"),
                                     *(2 * [backend.from_numpy(k_host[l], "float32")]),
                                     return_lse=True) for l in range(LAYERS)]
            for l in range(LAYERS):
                got = (backend.to_numpy(outs[l]), backend.to_numpy(lses[l]))
                np.testing.assert_array_equal(got[0], backend.to_numpy(eager[l][0]), err_msg=f"{i} {l}")
                np.testing.assert_array_equal(got[1], backend.to_numpy(eager[l][1]), err_msg=f"{i} {l}")
                rows = _live_rows(fixed_cache, l)
                for a, b in zip(rows, _live_rows(eager_cache, l)):
                    np.testing.assert_array_equal(a, b)
                _check_reference(*got, q_host[l], rows, n_new)
    assert list(fixed_cache.host_lens) == [h + sum(n[b] for n in n_news)
                                           for b, h in enumerate(WHOLE_HISTORY)]
    if storage == "paged":  # the replayed steps took pages: adopt uploaded each new table
        assert pages[-1] > pages[1], pages
    assert len(graph.ops) == LAYERS * 4  # per layer: the append, out's and lse's fills, attention
    assert all(s == per_step[0] for s in per_step[1:])  # eager steps' launches = the replays'
    assert len(per_step[0]) == 2 * LAYERS  # per layer: one append, one attention launch


def test_emulated_fixed_step_outside_invariant_mode_differs_from_eager(monkeypatch):
    """Why the bit-for-bit replay needs batch-invariant mode: outside it, a fixed decode
    plan splits each row's keys by the capacity (3 splits of MAX_LEN / 3) and the eager
    call by the row's length, so the merges add other partial sums (float32 rounding)."""
    backend = emu.kernels_only(monkeypatch, "fixed kernels")
    fixed_cache, _ = _filled(backend, "contiguous", 81)
    eager_cache, _ = _filled(backend, "contiguous", 81)
    rng = np.random.default_rng(82)
    q = backend.from_numpy(rng.standard_normal((B, HQ, 1, D)), "float32")
    k = backend.from_numpy(rng.standard_normal((B, HKV, 1, D)), "float32")
    with fixed_cache.step([1, 1, 1]) as step:
        plan = step.plan_attention(HQ, t_q=1, fixed=True, splits=3)
        got = [backend.to_numpy(step.attend(l, q, k, k, plan=plan)) for l in range(LAYERS)]
    with eager_cache.step([1, 1, 1]) as step:
        want = [backend.to_numpy(step.attend(l, q, k, k)) for l in range(LAYERS)]
    assert not all(np.array_equal(a, b) for a, b in zip(got, want))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_emulated_fixed_step_refusals(monkeypatch):
    """splits= in batch-invariant mode, a plan taken into the other mode, replay without
    an adopted plan or after a write, a write the fixed append does not serve (K/V of
    another T: the unplanned append, the same K/V)."""
    backend = emu.kernels_only(monkeypatch, "fixed kernels")
    cache, _ = _filled(backend, "contiguous", 91)
    with cache.step([1, 1, 1]) as step:
        with gqakv.batch_invariant(), pytest.raises(ValueError, match=r"splits=2: in batch-invariant"):
            step.plan_attention(HQ, t_q=1, fixed=True, splits=2)
        with pytest.raises(ValueError, match="replay needs this step to adopt"):
            step.replay(lambda: None)
        plan = step.plan_attention(HQ, t_q=2, fixed=True)
        x = backend.from_numpy(np.ones((B, HKV, 1, D)), "float32")  # T = 1, the plan's is 2
        for l in range(LAYERS):
            step.write(l, x, x)
        assert np.array_equal(backend.to_numpy(cache.store.k[:, 0, :, HISTORY[0]]), np.ones((LAYERS, HKV, D)))
    with cache.step([1, 1, 1]) as step:
        ints = plan.work.ints.get()
        with gqakv.batch_invariant(), pytest.raises(
                ValueError, match="made with batch-invariant mode off and the mode is on now"):
            step.adopt(plan)
        np.testing.assert_array_equal(plan.work.ints.get(), ints)  # nothing changed
        step.adopt(plan)
        step.write(0, x, x)
        with pytest.raises(ValueError, match=r"layers \[0\] were written already"):
            step.replay(lambda: None)
        for l in range(1, LAYERS):
            step.write(l, x, x)


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
def test_emulated_fixed_step_on_int8_storage(monkeypatch, storage):
    """The fixed append of a quantized cache (gqakv_write_kv_quantized over the plan's
    device ints): batch-invariant fixed steps give the eager steps' bits, and the same
    live K/V (decoded from codes and scales; the eager path's values against the reference: tests/test_cupy_quantized_emulated.py),
    with no allocation or copy after adopt. d = 8: the emulator's int8 library."""
    backend = emu.kernels_only(monkeypatch, "fixed kernels")
    d, kw = 8, (dict(page_size=PAGE) if storage == "paged" else {})
    caches = [gqakv.ModelKVCache(2, B, HKV, 64, d, backend=backend, kv_dtype="int8", **kw)
              for _ in range(2)]
    rng = np.random.default_rng(101)
    x = backend.from_numpy(rng.standard_normal((B, HKV, 20, d)), "float32")
    for c in caches:
        with c.step([20, 13, 15]) as step:
            for l in range(2):
                step.write(l, x, x)
    traffic = _DeviceTraffic(monkeypatch, backend)
    outs = [_garbage(backend, (B, HQ, 1, d)) for _ in range(2)]
    lses = [_garbage(backend, (B, HQ, 1)) for _ in range(2)]
    plan = None
    with gqakv.batch_invariant():
        for n_new in ([1, 1, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]):  # 16 crossed in row 2
            q = backend.from_numpy(rng.standard_normal((B, HQ, 1, d)), "float32")
            k = backend.from_numpy(rng.standard_normal((B, HKV, 1, d)), "float32")
            with caches[0].step(n_new) as step:
                if plan is None:
                    plan = step.plan_attention(HQ, t_q=1, fixed=True)
                    assert isinstance(plan.work.append, type(plan.work.plan)), plan.work.append
                else:
                    step.adopt(plan)
                traffic.calls.clear()
                traffic.on = True
                for l in range(2):
                    step.attend(l, q, k, k, plan=plan, out=outs[l], lse_out=lses[l])
            traffic.on = False  # the commit included
            assert traffic.calls == [], traffic.calls
            with caches[1].step(n_new) as step:
                want = [step.attend(l, q, k, k, return_lse=True) for l in range(2)]
            for l, (b, b_lse) in enumerate(want):
                np.testing.assert_array_equal(backend.to_numpy(outs[l]), backend.to_numpy(b))
                np.testing.assert_array_equal(backend.to_numpy(lses[l]), backend.to_numpy(b_lse))
    for l in range(2):  # the live tokens (dead slots hold whatever the allocation had)
        for b in range(B):
            for got, want in zip(*(c.live_kv(l, b) for c in caches)):
                np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(want))
