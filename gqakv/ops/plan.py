"""Plan once, run per layer: the part of an attention call that depends only on the batch.

A forward step runs the same batch through every layer: the same rows, lengths, n_new,
query shape and variant. ``AttentionPlan`` holds that part, validated once
(``gqakv.core.inputs.validate_attention_batch``) and planned once by the backend
(``Backend.plan_attention``: work items, key splits, merge layout, ...); ``run`` then
checks only the tensors it is handed (q, the outputs) and launches. ``gqa_attention`` is
a plan and one run; ``Step.attend`` plans on its first layer and runs every layer on that
plan; ``gqakv.plan_attention`` and ``Step.plan_attention`` hand the plan to an engine.

A backend that plans nothing (``plan_attention`` returns None: the default, so a
third-party backend keeps working) is called as before for each run, and the caller's
``out`` / ``lse_out`` are filled from its result; one that returns work receives it and
the caller's buffers (``attention(..., work=, out=, lse_out=)``) and writes into them.

A fixed plan (``fixed=True``; backends with ``plan_fixed_attention``, the cupy one) is
planned for the batch's capacities instead of its lengths, so what ``run`` launches stays
the same from step to step (CUDA graphs); ``update`` (or ``Step.adopt``) validates the
next batch and writes its lengths into the plan's device buffers in place. Its ``write``
is the step's append over the same buffers (cupy: a launch whose grid is fixed by T, no
upload), which ``Step.write`` / ``Step.attend`` use once the step adopted the plan, so a
whole step (append and attention, every layer) launches the same kernels with the same
arguments every time. In batch-invariant mode (``gqakv.core.invariance``) a fixed plan's
results are the bits of the eager call (an unplanned one, or a plan for the lengths):
neither splits keys by the batch; outside it, a fixed plan's decode splits the keys by
the capacity, an eager call by the lengths, and the results agree to float32 rounding.

Shared prefixes (``gqakv.ops.shared_prefix``): on paged storage, a plan whose batch has
entries that share enough pages before their new tokens reads those pages once per
group (a shared call and a suffix call, merged through the LSE); ``plan.shared_prefix``
says which groups were formed, or why none was, and the plan's repr shows it.
"""

from __future__ import annotations

import numpy as np

from ..core.inputs import (batch_of_n_new, check_flag, check_held_keys, check_outputs, check_queries, host_ints,
                           validate_attention_batch)
from . import shared_prefix as _shared_prefix
from .outputs import write_into


def packed_or_padded_shape(n_new, q_heads: int, head_dim: int, *, t_q=None,
                           packed: bool = False) -> tuple[int, ...]:
    """The queries' shape of a batch with these ``n_new`` ([B] ints): padded ``[B, q_heads,
    t_q, d]`` (``t_q`` default: the largest n_new) or packed ``[sum(n_new), q_heads, d]``."""
    packed = check_flag(packed, "packed")
    batch = batch_of_n_new(n_new)
    n = host_ints(n_new, "n_new", batch)  # checked first: its errors name it
    if packed:
        if t_q is not None:
            raise TypeError("t_q applies to padded queries [B, Hq, T, d]; packed queries "
                            "[N, Hq, d] hold exactly sum(n_new) tokens")
        return (int(sum(int(x) for x in n)), int(q_heads), int(head_dim))
    if t_q is None:
        t_q = max((int(x) for x in n), default=0)
    return (batch, int(q_heads), int(t_q), int(head_dim))


def check_invariant_route(backend, store, inputs, q_shape) -> None:
    """In batch-invariant mode (``inputs.invariant``), ValueError unless the implementation
    ``backend`` routes this call to declares the mode (``FastPath.invariant``): a call that
    would compute bits that depend on the batch is refused, naming the implementation."""
    spec = store.spec
    route = backend.route("attention", dtype=spec.q_dtype, head_dim=store.head_dim, layout=spec.kind,
                          codec=spec.codec.name, features=inputs.features,
                          **inputs.token_facts(q_shape))
    if route.impl not in backend.invariant_attention():
        why = "; ".join(f"not {name}: {reason}" for name, reason in route.rejected.items())
        raise ValueError(
            f"batch-invariant mode: backend {backend.name!r} would run {route.impl!r} for this call, "
            f"whose results depend on the batch ({why or 'it declares no batch-invariant path'}); "
            "the numpy, numba, torch and array_api_strict backends' attention honours the mode "
            "(gqakv.core.invariance), or turn it off")


class AttentionPlan:
    """An attention call's batch, validated and planned once (see the module docstring).

    Attributes:
        q_shape: ``(B, Hq, T, d)`` of the queries every run takes (packed: ``(N, Hq, d)``).
        inputs: the validated ``gqakv.core.inputs.AttentionInputs`` (rows, lens, n_new,
            params; host ints [B]).
        work: what the backend planned (None: it plans nothing ahead, or the batch runs
            as shared-prefix parts, each with its own plan).
        shared_prefix: the ``gqakv.ops.shared_prefix.SharedPrefix`` decision: the groups of
            entries whose shared pages are read once (``.groups``), or the ``.reason``
            none was formed (not paged, a window, too few shared tokens, ...).
    """

    __slots__ = ("backend", "spec", "kv_heads", "head_dim", "q_shape", "inputs", "work", "owner",
                 "fixed", "shared_prefix", "_shared", "_outputs_checked")

    def __init__(self, cache, q_shape, inputs, owner=None, *, fixed: bool = False, splits=None):
        self.owner = owner  # what made it (a Step checks that a plan handed to it is its own)
        self.backend = cache.backend
        self.spec = cache.store.spec
        self.kv_heads, self.head_dim = cache.kv_heads, cache.head_dim
        self.q_shape = tuple(int(s) for s in q_shape)
        self.inputs = inputs
        self._outputs_checked: tuple | None = None  # (see _check_outputs)
        self.fixed = check_flag(fixed, "fixed")
        if inputs.invariant:
            check_invariant_route(self.backend, cache.store, inputs, self.q_shape)
        if splits is not None and not self.fixed:
            raise TypeError("splits= applies to fixed plans (fixed=True)")
        self.shared_prefix = _shared_prefix.decide(cache.store, inputs, self.q_shape,
                                                   fixed=self.fixed, backend=self.backend)
        self._shared = None
        if self.shared_prefix.used:  # the two parts' plans instead of the whole batch's
            self._shared = _shared_prefix.SharedPrefixWork(self.backend, cache.store, inputs,
                                                           self.q_shape, self.shared_prefix)
            self.work = None
        elif self.fixed:
            if len(self.q_shape) == 3:
                raise ValueError("fixed plans take padded queries [B, Hq, T, d] (packed ones "
                                 "change shape with n_new)")
            if splits is not None and inputs.invariant:
                raise ValueError(f"splits={splits!r}: in batch-invariant mode attention never "
                                 "splits a row's keys (its bits would depend on the split); "
                                 "leave splits unset, or plan outside the mode")
            self.work = self.backend.plan_fixed_attention(cache.store, inputs, inputs.params,
                                                          self.q_shape, splits=splits)
        else:
            self.work = self.backend.plan_attention(cache.store, inputs, inputs.params,
                                                    self.q_shape)

    @classmethod
    def of(cls, cache, n_new, *, q_heads: int, t_q: int | None = None, packed: bool = False,
           rows=None, scale=None, params=None, window=None, softcap=None, sinks=None,
           alibi_slopes=None, fixed: bool = False, splits=None, tree=None) -> "AttentionPlan":
        """The plan of ``gqa_attention(q, cache, n_new, rows=rows, ...)`` for queries
        ``[len(n_new), q_heads, t_q, d]`` (``t_q`` default: the largest n_new), or packed
        ``[sum(n_new), q_heads, d]`` with ``packed=True``, validated against ``cache`` as
        it is now (run it before the cache changes). ``fixed``: planned for the
        capacities (B entries of t_q queries over rows of the cache's max_len; ``splits``
        decode splits) so that ``update`` takes each next batch in place (CUDA graphs;
        backends with ``plan_fixed_attention`` only)."""
        q_shape = packed_or_padded_shape(n_new, q_heads, cache.head_dim, t_q=t_q, packed=packed)
        inputs = validate_attention_batch(cache, q_shape, n_new, rows, scale, params, window=window,
                                          softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                                          tree=tree)
        return cls(cache, q_shape, inputs, fixed=fixed, splits=splits)

    def update(self, cache, n_new, *, rows=None) -> None:
        """A fixed plan's next batch: ``n_new`` / ``rows`` (the same B, n_new <= T)
        validated against ``cache`` as it is now (its lengths; the plan's variant) and
        written into the plan's device buffers in place, so the launches ``run`` issues
        stay the same (no allocation, no host-to-device copy in ``run``). Nothing changes
        when validation fails."""
        if not self.fixed:
            raise ValueError("update takes a fixed plan (plan_attention(..., fixed=True)); "
                             "plan again for a new batch")
        self.check_cache_kind(cache)
        if self.inputs.tree is not None:
            raise ValueError("a fixed plan with a draft tree cannot take a new batch (plan again)")
        inputs = validate_attention_batch(cache, self.q_shape, n_new, rows, params=self.params)
        if inputs.invariant != self.inputs.invariant:  # its launches are the mode's
            raise ValueError(f"the plan was made with batch-invariant mode "
                             f"{'on' if self.inputs.invariant else 'off'} and the mode is "
                             f"{'on' if inputs.invariant else 'off'} now: plan again in this mode")
        self.backend.update_attention(self.work, cache.store, inputs)
        self.inputs = inputs

    def write(self, store, k_new, v_new, inputs) -> None:
        """The append of ``k_new`` / ``v_new`` (validated ``AppendInputs`` over ``store``, a
        layer's store without leading axes): a fixed plan's backend runs it over the plan's
        device buffers when they hold this append (cupy: ``write_kv(..., work=)``, a grid
        fixed by T, nothing uploaded), else as an unplanned append (``Backend.write_kv``)."""
        if self.fixed and self.work is not None:
            self.backend.write_kv(store, k_new, v_new, inputs, work=self.work)
        else:
            self.backend.write_kv(store, k_new, v_new, inputs)

    @property
    def params(self):
        """The call's ``AttentionParams`` (scale and variant)."""
        return self.inputs.params

    def run(self, q, cache, *, return_lse: bool = False, out=None, lse_out=None):
        """Attention of ``q`` (``q_shape``) over ``cache``, a cache of the same backend,
        storage, heads and head dim whose rows still hold the planned lengths (another
        layer of the same step, or the planned cache before it changes); see
        ``gqa_attention`` for the semantics and the result. ``out`` (q's shape and dtype)
        and ``lse_out`` (q's shape without d; float32, float64 for float64 caches) receive
        the results when given, checked before anything is written."""
        return_lse = check_flag(return_lse, "return_lse")
        self.check_cache(cache)
        self.check_tensors(cache, q, out, lse_out)
        return self.launch(q, cache.store, return_lse, out, lse_out)

    def check_cache(self, cache) -> None:
        """ValueError unless ``cache`` is one this plan runs over (see ``run``)."""
        self.check_cache_kind(cache)
        rows, lens = self.inputs.rows, self.inputs.lens
        if int(rows.max(initial=-1)) >= cache.batch:
            raise ValueError(f"the plan reads rows up to {int(rows.max())}; this cache has "
                             f"{cache.batch} rows")
        now = cache.host_lens[rows]
        if not np.array_equal(now, lens):
            i = int(np.flatnonzero(now != lens)[0])
            raise ValueError(f"the plan is stale: row {int(rows[i])} held {int(lens[i])} tokens "
                             f"when it was planned and holds {int(now[i])} now (plan again "
                             "after every append)")
        if self._shared is not None:  # its page tables were read when it was planned
            moved = self._shared.moved_row(cache.store)
            if moved is not None:
                raise ValueError(f"the plan is stale: row {moved}'s pages changed since it was "
                                 "planned (a reorder, fork or copy on write; plan again)")

    def check_cache_kind(self, cache) -> None:
        """ValueError unless ``cache`` has the plan's backend, storage, heads and head dim."""
        if cache.backend is not self.backend:
            raise ValueError(f"the plan was made for backend {self.backend.name!r}, the cache "
                             f"is on {cache.backend.name!r}")
        if (cache.store.spec != self.spec or cache.kv_heads != self.kv_heads
                or cache.head_dim != self.head_dim):
            raise ValueError(f"the plan was made for {self.spec.dtype} {self.spec.kind} storage "
                             f"with Hkv={self.kv_heads}, d={self.head_dim}; this cache has "
                             f"{cache.store.spec.dtype} {cache.store.kind}, Hkv={cache.kv_heads}, "
                             f"d={cache.head_dim}")

    def check_tensors(self, cache, q, out=None, lse_out=None) -> None:
        """The per-run checks: ``q`` (library, device, rank, dtype and ``q_shape``), the
        caller's output buffers, and that ``cache`` still holds every key the plan reads
        (a layer in window-sized storage, run with a plan made on another layer:
        ``check_held_keys``)."""
        check_queries(cache, q)
        self.check_checked_queries(cache, q, out, lse_out)

    def check_checked_queries(self, cache, q, out=None, lse_out=None) -> None:
        """``check_tensors`` after ``check_queries(cache, q)`` passed (a step's first
        layer checks q before it looks up its plan; the later checks are the same)."""
        inputs = self.inputs
        check_held_keys(cache.store, inputs.params, inputs.rows, inputs.lens, inputs.n_new)
        shape = q.shape
        if (shape if type(shape) is tuple else tuple(int(s) for s in shape)) != self.q_shape:
            names = "[N, Hq, d]" if len(self.q_shape) == 3 else "[B, Hq, T, d]"
            raise ValueError(f"q has shape {list(q.shape)}, the plan is for {list(self.q_shape)} "
                             f"{names}")
        if out is not None or lse_out is not None:
            self._check_outputs(cache, out, lse_out)

    def _check_outputs(self, cache, out, lse_out) -> None:
        """``check_outputs``, in full once per signature of out and lse_out
        (``Backend.signature``) and spec of the layer: a step's layers pass alike buffers."""
        signature = self.backend.signature
        sig_out = None if out is None else signature(out)
        sig_lse = None if lse_out is None else signature(lse_out)
        unsigned = (out is not None and sig_out is None) or (lse_out is not None and sig_lse is None)
        key = (out is None, sig_out, lse_out is None, sig_lse, cache.store.spec)
        if unsigned or self._outputs_checked != key:
            check_outputs(cache, self.q_shape, out, lse_out)
            self._outputs_checked = None if unsigned else key

    def launch(self, q, store, return_lse: bool, out=None, lse_out=None):
        """The backend's attention of checked tensors over ``store`` (no checks here)."""
        codec = store.codec
        if codec.rotates_keys:  # keys are stored rotated: q . k needs q in their basis
            return self._launch_rotated(codec, q, store, return_lse, out, lse_out)
        return self._launch(q, store, return_lse, out, lse_out)

    def _launch(self, q, store, return_lse: bool, out=None, lse_out=None):
        backend, inputs = self.backend, self.inputs
        if self._shared is not None:
            return self._shared.launch(q, store, return_lse, out, lse_out)
        if self.work is None:
            if out is None and lse_out is None:
                return backend.attention(q, store, inputs, inputs.params, return_lse=return_lse)
            result = backend.attention(q, store, inputs, inputs.params, return_lse=True)
            return write_into(result, return_lse, out, lse_out)
        result = backend.attention(q, store, inputs, inputs.params, return_lse=True,
                                   work=self.work, out=out, lse_out=lse_out)
        return result if return_lse else result[0]

    def _launch_rotated(self, codec, q, store, return_lse: bool, out, lse_out):
        """``launch`` over keys stored rotated: q rotated alike, kept in float32 (float64 for
        float64) so a 16-bit q is not rounded twice (the backends compute in float32 and
        the keys are decoded to it), the output cast back to q's dtype."""
        xp = self.backend.namespace()
        o, lse = self._launch(codec.rotate_queries(xp, q), store, True)
        if o.dtype != q.dtype:
            o = xp.astype(o, q.dtype)
        return write_into((o, lse), return_lse, out, lse_out)

    def __repr__(self) -> str:
        return (f"<AttentionPlan {self.backend.name} q {list(self.q_shape)} "
                f"n_new={self.inputs.n_new.tolist()} {self.params.variant}; "
                f"{self.shared_prefix}>")
