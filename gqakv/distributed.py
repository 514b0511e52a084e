"""Tensor parallelism over ``torch.distributed``: each rank holds a slice of the heads.

A model split over P ranks by heads (as Megatron, vLLM and TensorRT-LLM split it):

- **Heads.** Rank r holds ``Hkv / P`` consecutive KV heads and the ``Hq / P`` query heads
  that read them, so attention needs no communication: every rank runs its own
  ``ModelKVCache`` (``model_cache``) holding only its KV heads, through the same
  ``ModelKVCache.step`` API as one device.
- **P > Hkv** (more ranks than KV heads): P must be a multiple of Hkv, and each KV head
  is *replicated* on ``R = P / Hkv`` consecutive ranks; rank r holds KV head ``r // R``
  and the query heads ``r * Hq / P ... (r + 1) * Hq / P - 1``, a ``1 / R`` share of that KV
  head's group (vLLM's rule; needs ``Hq % P == 0``). Each replica writes and reads its
  own copy, so the cache memory of the whole group is R x that of one device.
- **Projections** (the model's business; ``gqakv_examples.llama`` does it):
  column-parallel Q/K/V and MLP gate/up (each rank computes its heads' and its
  ``F / P`` columns' outputs), row-parallel attention output and MLP down
  projections, whose partial sums are joined by one ``all_reduce`` each: two per layer.

Arrays cross to the communication library by DLPack: ``all_reduce`` hands
``torch.from_dlpack(x)`` (no copy: the same memory) to ``torch.distributed``, so NumPy
arrays go to gloo and CuPy arrays to NCCL through torch's process group. For CuPy that
is the route chosen over ``cupy.cuda.nccl``: the process group torchrun sets up already
holds an NCCL communicator, its rendezvous and its timeout; a second, CuPy-owned
communicator would need its own unique-id exchange and would not share the failure
handling below. The price is that CuPy's stream is synchronized before the collective
and torch's after it (torch runs NCCL on its own stream).

A step is all-or-nothing on every rank (``StepGuard``): a rank whose local work raises
keeps taking part in the step's remaining collectives, contributing zeros and a
failure flag carried in the all-reduced buffer (P extra elements, one per rank); once
the flags show a failure every rank aborts its cache step (``Step.abort``: lengths and
pages as before; only dead slots past the lengths were written) and raises
``TensorParallelError`` naming the failing ranks. A rank that dies is caught by the
process group's timeout (``init``): over gloo the collective raises on the survivors, who
abort too; over NCCL torch's watchdog ends the survivors' processes instead (its default
``TORCH_NCCL_ASYNC_ERROR_HANDLING``), as the timed-out collective never returns an error.

Planning (``HeadShard.plan``) needs no torch; everything that communicates does.
"""

from __future__ import annotations

import datetime
import math
import os

import numpy as np

from .caches.model_cache import ModelKVCache
from .core.dims import check_dim as _int  # the int-argument check every gqakv constructor uses
from .core.shard import PLAN_INT_MAX, HeadShard, even_slice  # noqa: F401  (re-exported: gqakv.distributed.HeadShard)
from .dispatch.backend import Backend
from .dispatch.registry import get_backend

#: Seconds a collective may wait for its peers before it raises (``init``'s default).
DEFAULT_TIMEOUT_S = 300.0


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # torch is optional for gqakv, required here
        raise ImportError("gqakv.distributed needs torch (pip install torch): "
                          f"{exc}") from exc
    if not dist.is_available():
        raise ImportError("gqakv.distributed needs a torch built with torch.distributed")
    return torch, dist


class TensorParallelError(RuntimeError):
    """A step failed on some rank; every rank aborted its cache step and raises this."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...]):
        super().__init__(message)
        self.failed_ranks = failed_ranks


# -- the process group -----------------------------------------------------------------------


def init(world_size: int | None = None, *, backend: str | None = None, device_kind: str = "cpu",
         timeout_s: float = DEFAULT_TIMEOUT_S):
    """Join (or check) the default process group and return its ``TensorParallel``.

    Started by torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the
    environment) it joins through ``env://``; with no launcher and ``world_size`` 1 it
    makes a one-process group. ``backend``: "gloo" or "nccl" (default: nccl for
    ``device_kind="cuda"``, gloo otherwise). ``timeout_s`` bounds every collective, so a
    dead peer does not leave the others hanging: over gloo their collective raises, over
    NCCL torch's watchdog ends their processes. ``world_size``, when given, must be the
    group's size.
    """
    _, dist = _torch()
    if world_size is not None:
        world_size = _int("world_size", world_size, 1)
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
                                           and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    if device_kind not in ("cpu", "cuda"):
        raise ValueError(f"device_kind={device_kind!r} must be 'cpu' or 'cuda' (it picks the default "
                         "communication backend: gloo or nccl)")
    if not dist.is_initialized():
        backend = backend or ("nccl" if device_kind == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=float(timeout_s))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if world_size is not None and int(os.environ["WORLD_SIZE"]) != world_size:
                raise ValueError(
                    f"tensor parallel size {world_size} needs {world_size} processes, but the launcher "
                    f"started WORLD_SIZE={os.environ['WORLD_SIZE']} (torchrun --nproc-per-node {world_size} ...)")
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        elif world_size in (None, 1):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            raise ValueError(
                f"tensor parallel size {world_size} needs {world_size} processes started by a launcher, "
                f"e.g. torchrun --nproc-per-node {world_size} -m gqakv generate --tensor-parallel "
                f"{world_size} ... (no RANK/WORLD_SIZE in this process's environment)")
    tp = TensorParallel()
    if world_size is not None and tp.world_size != world_size:
        raise ValueError(f"tensor parallel size {world_size} does not match the process group's "
                         f"{tp.world_size} ranks")
    return tp


def local_device_index() -> int:
    """This process's GPU on its node: torchrun's ``LOCAL_RANK`` (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_backend(backend=None, *, dtype=None, head_dim: int | None = None):
    """The gqakv backend for this rank, bound to the rank's device by the backend itself
    (``Backend.for_local_device(LOCAL_RANK)``: torch on CUDA gets ``cuda:LOCAL_RANK``, CuPy
    makes ``LOCAL_RANK`` its current device; CPU backends are as ``gqakv.get_backend``
    returns them)."""
    chosen = get_backend(backend, dtype=dtype, head_dim=head_dim)
    return chosen.for_local_device(local_device_index())  # the backend's own binding


class TensorParallel:
    """This rank's place in a tensor-parallel process group, and its collectives.

    Args:
        group: a ``torch.distributed`` process group (None: the default group, which
            must be initialized: ``init`` or ``torch.distributed.init_process_group``).
    """

    def __init__(self, group=None):
        _, dist = _torch()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call gqakv.distributed.init() "
                               "or torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.comm_backend = str(dist.get_backend(group))

    def heads(self, n_heads: int, n_kv_heads: int) -> HeadShard:
        """The query and KV heads this rank holds (``HeadShard.plan``)."""
        return HeadShard.plan(n_heads, n_kv_heads, self.world_size, self.rank)

    def columns(self, n: int, what: str = "size") -> slice:
        """This rank's share of ``n`` columns (``even_slice``)."""
        return even_slice(n, self.world_size, self.rank, what)

    def model_cache(self, layers: int, batch: int, n_heads: int, kv_heads: int, max_len: int,
                    head_dim: int, dtype="float32", backend=None, **options):
        """A ``ModelKVCache`` holding only this rank's KV heads, ``[layers, B, Hkv_local,
        max_len, d]`` on the rank's device (``rank_backend``). ``kv_heads`` and ``n_heads``
        are the full model's; ``options`` are ModelKVCache's (``page_size``, ``num_pages``,
        ``kv_dtype``, ``storage``)."""
        shard = self.heads(n_heads, kv_heads)
        if not isinstance(backend, Backend):
            backend = rank_backend(backend, dtype=dtype, head_dim=head_dim)
        return ModelKVCache(layers, batch, shard.local_kv_heads, max_len, head_dim, dtype, backend,
                            **options)

    def all_reduce(self, x):
        """Sum ``x`` over the group in place (a contiguous array of any gqakv backend, handed
        to torch by DLPack without a copy); returns ``x``."""
        torch, dist = _torch()
        t = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        foreign_cuda = t.is_cuda and not isinstance(x, torch.Tensor)
        if foreign_cuda:  # CuPy: its queued writes must land before NCCL reads the memory
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        if foreign_cuda:  # and NCCL's result before CuPy reads it
            torch.cuda.current_stream(t.device).synchronize()
        return x

    def guard(self, backend, shape: tuple[int, ...], dtype: str) -> "StepGuard":
        """A ``StepGuard`` for one forward step whose reduced activations are ``shape``."""
        return StepGuard(self, backend, shape, dtype)

    def __repr__(self) -> str:
        return f"<TensorParallel rank {self.rank} of {self.world_size} ({self.comm_backend})>"


class StepGuard:
    """One forward step run so that a failure on any rank aborts it on every rank.

    Local work goes through ``run(fn)``; the row-parallel joins through
    ``add_reduced(x, fn)``; ``finish()`` ends the step. A rank whose ``fn`` raises
    keeps the exception, stops computing, and still joins the step's collectives with
    zeros and its flag set; every rank learns of the failure from the same reduced
    buffer, at the same collective, so all of them stop communicating together and
    ``finish`` raises ``TensorParallelError`` everywhere. Every rank must make the same
    sequence of ``add_reduced`` calls (the model's layer loop guarantees it).

    ``shape``: the reduced activations, ``[B, T, D]``; the buffer is ``prod(shape) + P``
    elements of ``dtype`` (the P flags are exact small integers in any float dtype).
    """

    def __init__(self, tp: TensorParallel, backend, shape, dtype: str):
        self.tp, self.backend, self.dtype = tp, backend, dtype
        self.shape = tuple(int(s) for s in shape)
        self.size = math.prod(self.shape)
        self.error: BaseException | None = None  # what this rank raised
        self.failed_ranks: tuple[int, ...] = ()  # known to every rank alike
        self.reduces = 0

    @property
    def failed(self) -> bool:
        return self.error is not None or bool(self.failed_ranks)

    def run(self, fn):
        """``fn()``, or None when this step already failed here or anywhere (an exception
        from ``fn`` is kept for ``finish``)."""
        if self.failed:
            return None
        try:
            return fn()
        except Exception as exc:  # re-raised on every rank by finish(), as TensorParallelError
            self.error = exc
            return None

    def add_reduced(self, x, fn):
        """``x + all_reduce(fn())`` (``fn`` returns this rank's partial ``shape`` sum), or
        None once the step failed on any rank."""
        if self.failed_ranks:  # every rank knows: no more collectives in this step
            return None
        xp = self.backend.namespace()
        # The flattening and the sum run guarded too: a part of the wrong shape on one rank
        # must set its flag, not leave the others waiting in the collective until the timeout.
        part = self.run(lambda: xp.reshape(fn(), (self.size,)))
        buf = self._reduce(part)
        if self.failed:
            return None
        return self.run(lambda: x + xp.reshape(buf[: self.size], self.shape))

    def finish(self) -> None:
        """End the step's communication: raise ``TensorParallelError`` on every rank when
        any rank failed (after one last flags-only reduce, unless the failure is already
        known everywhere); return when all succeeded."""
        if not self.failed_ranks:
            saved, self.size = self.size, 0  # the vote: the P flags alone
            try:
                self._reduce(None)
            finally:
                self.size = saved
        if self.failed_ranks:
            ranks = ", ".join(map(str, self.failed_ranks))
            here = (f"; here: {type(self.error).__name__}: {self.error}" if self.error is not None
                    else "")
            raise TensorParallelError(
                f"tensor-parallel step aborted on all {self.tp.world_size} ranks: rank(s) {ranks} "
                f"raised (this is rank {self.tp.rank}){here}; every rank's cache is unchanged",
                self.failed_ranks) from self.error

    def _reduce(self, part):
        P, rank = self.tp.world_size, self.tp.rank
        xp = self.backend.namespace()
        device = None if part is None else self.backend.device_of(part)
        buf = self._zeros(xp, self.size + P, device)
        if part is not None and self.error is None:
            buf[: self.size] = part  # [size], flattened by add_reduced
        if self.error is not None:
            buf[self.size + rank] = 1
        self.tp.all_reduce(buf)
        self.reduces += 1
        flags = self.backend.to_numpy(buf[self.size:])
        self.failed_ranks = tuple(int(i) for i in np.flatnonzero(flags))
        return buf

    def _zeros(self, xp, n: int, device):
        if device is None:
            device = getattr(self.backend, "_target_device", lambda: None)()
        if device is None:
            return xp.zeros((n,), dtype=self.backend.dtype(self.dtype))
        return xp.zeros((n,), dtype=self.backend.dtype(self.dtype), device=device)
