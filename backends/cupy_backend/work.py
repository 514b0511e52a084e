"""A planned attention batch on the device: what every layer of a step shares, made once.

``CupyBackend.plan_attention`` returns a ``CupyWork`` for a batch its fused kernels serve
(padded queries; packed ones take the generic code on CuPy, so they get no work): the
kernel plan (``plan.Plan``), the device index arrays the kernels read (rows / lens /
n_new / starts ``[B]`` int64 from one upload, the sinks and ALiBi slopes ``[Hq]`` float32, a draft
tree's ancestor sets ``[B, S, S]`` uint8 and depths ``[B, S]`` int64 (``tree_arrays``), a paged
store's table ``[R, pages_per_row]`` int32) and the split workspaces the plan names
(``part_o`` / ``part_lse``, and the 1-element ``dummy``), all allocated once. A run then
hands these to the launcher as they are: no host-to-device copy, and no allocation when
the caller gives ``out`` / ``lse_out`` the kernels can write.

Fixed mode (``fixed=True``: CUDA graphs): the plan is made for the batch's capacity, not
its lengths: every row as long as the store holds (``store.max_len`` keys) and every entry
with T queries, at a split count fixed up front. The launch grid and every scalar argument
(``keys_per_split`` included) then depend on the shapes only; the kernels already read each
row's own length and n_new from the device arrays (a split past a row's keys writes lse
-inf, ``write_empty_split``; blocks past n_new return), so ``update`` rewrites those
arrays in place (``ndarray.set``) for the next step and the launches stay the same.

A fixed work also plans the step's append (``append``: gqakv_write_kv's launch for T new
tokens per entry, its grid fixed by T, not by the largest n_new): it reads the same device
rows / n_new and the ``starts`` row (lens - n_new) and the same page table, so one
``update`` readies the whole step, and ``Step.write`` under an adopted fixed plan
(``gqakv.ops.plan.AttentionPlan.write``) uploads nothing (``serves_write`` says when it
applies).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gqakv.core.inputs import AttentionInputs

from .plan import Plan


@dataclass(eq=False)
class CupyWork:
    """One batch's planned attention (see the module docstring).

    Attributes:
        inputs: the ``AttentionInputs`` it serves (``attention`` uses it for that one only).
        q_shape: ``(B, Hq, T, d)``.
        dtype, kv_dtype, head_dim: what the kernels were instantiated for.
        kwargs: the planner's keywords (``plan.plan_attention``): strides of the planning
            layer's K/V and of C-contiguous q / out; a run with other strides replans
            with its own (the buffers stay the work's).
        plan: the kernel plan for ``kwargs``.
        device: the device id the arrays live on; stream: the stream the uploads were
            queued on. A run on another stream is not planned (the uploads may not have
            landed for it, and two streams would share the workspaces), except for a fixed
            work, whose caller orders its streams (a CUDA graph is captured on its own).
        arrays: name -> device array: rows, lens, n_new, starts, [sinks], [alibi],
            [tree_mask, tree_depth], [table], [part_o, part_lse], dummy.
        ints: the ``[4, B]`` int64 array rows / lens / n_new / starts are views of
            (``pack_ints``).
        table: the ``table_stamp`` of the page table whose entries were uploaded (paged):
            a run checks they still hold.
        fill: out / lse need their 0 / -inf before the launch (padded queries or idle
            rows; always in fixed mode, whose lengths change without a replan).
        fixed: made for capacities (``update`` takes new lengths).
        append: a fixed work's append plan (``plan.plan_write_kv`` for T tokens per entry
            into contiguous k_new ``[B, Hkv, T, d]``), or the reason it has none (a
            sentence: the step's append is then the unplanned one); None when not fixed.
        write_inputs: (append inputs, attention inputs) that ``serves_write`` last found to
            hold the same rows, starts and n_new (a step's layers append the same inputs:
            the next layer compares identities, not values).
    """

    inputs: AttentionInputs
    q_shape: tuple[int, int, int, int]
    dtype: str
    kv_dtype: str | None
    head_dim: int
    kwargs: dict
    plan: Plan
    device: int
    stream: int = 0  # the stream it was planned on (its uploads were queued there)
    arrays: dict = field(default_factory=dict)
    ints: Any = None  # a device array (the runtime's cp.ndarray)
    table: tuple | None = None  # table_stamp(the uploaded page table)
    fill: bool = True
    fixed: bool = False
    append: Plan | str | None = None
    write_inputs: tuple | None = None


#: The rows of ``pack_ints``' array, in order: the names the kernels' plans give them.
INTS = ("rows", "lens", "n_new", "starts")


def pack_ints(rows, lens, n_new) -> np.ndarray:
    """rows, lens (after the append), n_new ([B] host ints) and starts = lens - n_new (where
    the append writes: a fixed work's append reads them) as the ``[4, B]`` int64 array
    uploaded at once."""
    rows, lens, n_new = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (rows, lens, n_new))
    return np.array([rows, lens, n_new, lens - n_new], dtype=np.int64)


def table_entries(store) -> np.ndarray:
    """A paged store's page table as the kernels read it: ``[R, pages_per_row]`` int32,
    C-ordered (a copy only where the entries are not that already)."""
    return np.ascontiguousarray(store.page_table.entries, dtype=np.int32)


def table_stamp(table) -> tuple:
    """What says a page table still holds the entries it held when stamped: the table,
    its ``entries`` array and its ``version`` (``PageTable`` counts every change it makes
    to its entries; a caller's ``PageTableView`` never changes). Every layer of a step
    asks, so a stamp is compared by identity (``same_table``), not by the entries' bytes."""
    return (table, table.entries, table.version)


def same_table(stamp: tuple | None, table) -> bool:
    """Whether ``table`` is the one ``stamp`` (``table_stamp``'s) was made of, unchanged."""
    return (stamp is not None and stamp[0] is table and stamp[1] is table.entries
            and stamp[2] == table.version)


_TREE_ARRAYS: "weakref.WeakKeyDictionary[Any, tuple[np.ndarray, np.ndarray]]" = weakref.WeakKeyDictionary()


def tree_arrays(tree) -> tuple[np.ndarray, np.ndarray]:
    """A draft tree (``gqakv.core.tree.DraftTree``) as the kernels read it (variant.cuh,
    under the tree flag): the ancestor sets ``[B, S, S]`` uint8 (1 where chunk token u is t
    or one of its ancestors; 0 at padded slots) and the depths ``[B, S]`` int64, C-ordered,
    S the tree's tokens per entry (``tree_stride``). Made once per tree (every layer of a
    step uploads the same bytes)."""
    got = _TREE_ARRAYS.get(tree)
    if got is None:
        mask = np.ascontiguousarray(tree.ancestor_mask(), dtype=np.uint8)
        depth = np.ascontiguousarray(tree.depth, dtype=np.int64)
        got = _TREE_ARRAYS[tree] = (mask, depth)
    return got


def tree_stride(inputs) -> int | None:
    """The planner's ``tree_stride`` for ``inputs`` (None without a draft tree)."""
    tree = getattr(inputs, "tree", None)
    return None if tree is None else int(tree.parents.shape[1])


def needs_fill(q_shape, n_new, fixed: bool) -> bool:
    """Whether out / lse must be pre-filled (0 / -inf): some padded query or idle row
    that no kernel writes, or a fixed plan (its next lengths are not known)."""
    B, _, T, _ = q_shape
    return fixed or not (B and T and int(np.min(n_new)) == T)


def upload(cp, work: CupyWork, store, params, put=None) -> None:
    """Allocate and fill the work's device arrays (on the current device): the one
    host-to-device copy of the batch's ints, the variant's floats, the page table, and
    the plan's workspaces (uninitialized: the kernels write every element they read).

    put: ``put(host) -> device array``, the copy to the device (default ``cp.asarray``: the
    work's own arrays, which a fixed work must have, ``update`` writing into them); the
    backend passes its by-value uploads for other works, so that a batch planned again
    (``gqa_attention`` per layer: a plan per call) finds the last one's arrays."""
    put = put or cp.asarray
    inputs = work.inputs
    work.ints = put(pack_ints(inputs.rows, inputs.lens, inputs.n_new))
    for i, name in enumerate(INTS):
        work.arrays[name] = work.ints[i]
    if params.sinks is not None:
        work.arrays["sinks"] = put(np.asarray(params.sinks, dtype=np.float32))
    if params.alibi_slopes is not None:
        work.arrays["alibi"] = put(np.asarray(params.alibi_slopes, dtype=np.float32))
    if inputs.tree is not None:
        work.arrays["tree_mask"], work.arrays["tree_depth"] = (put(a) for a in tree_arrays(inputs.tree))
    if work.kwargs.get("pages") is not None:
        work.table = table_stamp(store.page_table)
        work.arrays["table"] = put(table_entries(store))
    for name, shape in work.plan.workspace.items():
        work.arrays[name] = cp.empty(shape, dtype=cp.float32)
    work.arrays["dummy"] = cp.empty(1, dtype=cp.float32)


def update(work: CupyWork, store, inputs) -> None:
    """A fixed work's device ints (and page table) rewritten in place for ``inputs`` (the
    same B; lengths within the capacity it was planned for): copies into the arrays the
    launches name, no allocation on the device."""
    work.ints.set(pack_ints(inputs.rows, inputs.lens, inputs.n_new))
    if work.table is not None:
        work.arrays["table"].set(table_entries(store))
        work.table = table_stamp(store.page_table)
    work.inputs = inputs


def serves_write(work: CupyWork, inputs, store, k_new, device: int | None) -> bool:
    """Whether a fixed ``work`` may run an append (``AppendInputs`` ``inputs``): it has an
    append plan, k_new is padded ``[B, Hkv, T, d]`` at the planned B and T, the rows,
    starts and n_new are the ones its device ints hold (the step it was updated for), on
    its device, and (paged) through the same page table as uploaded. Any stream (the
    caller orders them, as for its attention)."""
    if not (work.fixed and isinstance(work.append, Plan) and work.device == device):
        return False
    B, _, T, _ = work.q_shape
    if inputs.offsets is not None or k_new.ndim != 4 or (k_new.shape[0], k_new.shape[2]) != (B, T):
        return False
    planned = work.inputs
    seen = work.write_inputs
    if not (seen is not None and seen[0] is inputs and seen[1] is planned):
        if not (np.array_equal(inputs.rows, planned.rows)
                and np.array_equal(inputs.n_new, planned.n_new)
                and np.array_equal(inputs.starts, planned.lens - planned.n_new)):
            return False
        work.write_inputs = (inputs, planned)
    return holds_table(work, store)


def holds_table(work: CupyWork, store) -> bool:
    """Whether ``store`` reads through the table ``work`` uploaded, its entries still what
    was uploaded (a reorder keeps lengths but moves pages); True for contiguous work."""
    return work.table is None or same_table(work.table, store.page_table)


def serves(work: CupyWork, inputs, store, device: int | None, stream: int) -> bool:
    """Whether ``work`` may run this call: planned for these very ``inputs``, on the
    store's device and this stream (see ``CupyWork``), and (paged) through the same page
    table, whose entries still hold what was uploaded (a reorder keeps lengths but moves
    pages)."""
    if work.inputs is not inputs or work.device != device:
        return False
    if stream != work.stream and not work.fixed:
        return False
    return holds_table(work, store)
