"""How a model's heads split over ranks (``HeadShard.plan``, ``even_slice``): planning only,
no torch. ``gqakv.distributed`` runs the split; ``gqakv.storage.sizing`` sizes one device's
share of a cache with it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dims import check_dim as _int  # the int-argument check every gqakv constructor uses

#: The largest head count, world size or rank ``HeadShard.plan`` takes (2**31 - 1):
#: torch.distributed's ranks and world sizes are 32-bit ints, and so are the head counts
#: and indices the CUDA kernels take.
PLAN_INT_MAX = 2**31 - 1


def _plan_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int in ``minimum..PLAN_INT_MAX``; TypeError/ValueError naming ``name``."""
    v = _int(name, value, minimum)
    if v > PLAN_INT_MAX:
        raise ValueError(f"{name}={v} is out of range: {name} must be at most {PLAN_INT_MAX} "
                         "(2**31 - 1: ranks, world sizes and head counts are 32-bit ints)")
    return v


@dataclass(frozen=True)
class HeadShard:
    """The heads rank ``rank`` of ``world_size`` holds (``plan`` says how they are chosen).

    Query heads ``q_start:q_stop`` and KV heads ``kv_start:kv_stop`` of the full model;
    query head h of the full model reads KV head ``h // G``, so local query head j reads
    local KV head ``j // (G / replicas)``: the grouping inside a rank is GQA again.
    ``replicas``: ranks holding each KV head (1 unless world_size > n_kv_heads).
    """

    world_size: int
    rank: int
    n_heads: int  # Hq of the full model
    n_kv_heads: int  # Hkv of the full model
    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    replicas: int

    @classmethod
    def plan(cls, n_heads: int, n_kv_heads: int, world_size: int, rank: int = 0) -> "HeadShard":
        """Split ``n_heads`` query / ``n_kv_heads`` KV heads over ``world_size`` ranks.

        ``n_kv_heads % world_size == 0``: each rank gets ``Hkv / P`` KV heads and their
        ``Hq / P`` query heads. ``world_size % n_kv_heads == 0`` (P > Hkv): each KV head is
        replicated on ``P / Hkv`` ranks, each of which takes ``Hq / P`` of its query heads.
        Anything else raises ValueError saying which P would work. Each argument must be an
        int (bools refused; NumPy ints taken): ``n_heads``, ``n_kv_heads`` and
        ``world_size`` in ``1..PLAN_INT_MAX``, ``rank`` in ``0..world_size - 1``.
        """
        P = _plan_int("world_size", world_size, 1)
        r = _rank(rank, P)  # 0 <= rank < world_size <= PLAN_INT_MAX
        hq = _plan_int("n_heads", n_heads, 1)
        hkv = _plan_int("n_kv_heads", n_kv_heads, 1)
        if hq % hkv:
            raise ValueError(f"n_heads={hq} must be a multiple of n_kv_heads={hkv} (grouped-query attention)")
        if hkv % P == 0:
            per = hkv // P
            g = hq // hkv
            return cls(P, r, hq, hkv, r * per * g, (r + 1) * per * g, r * per, (r + 1) * per, 1)
        if P % hkv:
            works = sorted(p for p in {*_divisors(hkv), *(hkv * m for m in (2, 4, 8))}
                           if p <= PLAN_INT_MAX and hq % p == 0)
            raise ValueError(
                f"world_size={P} cannot split n_kv_heads={hkv}: it must divide the KV heads (each rank "
                f"holds Hkv / P of them) or be a multiple of them (each KV head replicated on P / Hkv "
                f"ranks); e.g. world_size in {works}")
        if hq % P:
            raise ValueError(
                f"world_size={P} > n_kv_heads={hkv} replicates each KV head on {P // hkv} ranks, "
                f"which then split its {hq // hkv} query heads: n_heads={hq} must be a multiple "
                f"of world_size={P}")
        per_q = hq // P
        kv = r // (P // hkv)
        return cls(P, r, hq, hkv, r * per_q, (r + 1) * per_q, kv, kv + 1, P // hkv)

    @property
    def local_heads(self) -> int:
        """Query heads on this rank (``Hq / P``)."""
        return self.q_stop - self.q_start

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (``max(1, Hkv / P)``)."""
        return self.kv_stop - self.kv_start

    def __str__(self) -> str:
        rep = "" if self.replicas == 1 else f" (each KV head on {self.replicas} ranks)"
        return (f"rank {self.rank}/{self.world_size}: query heads {self.q_start}..{self.q_stop - 1}, "
                f"KV heads {self.kv_start}..{self.kv_stop - 1}{rep}")


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n >= 1`` (trial division up to sqrt(n): at most 46,341 steps for
    n <= PLAN_INT_MAX, where a scan of 1..n would take minutes)."""
    small = [p for p in range(1, math.isqrt(n) + 1) if n % p == 0]
    return small + [n // p for p in small]


def _rank(rank, world_size: int) -> int:
    r = _int("rank", rank, 0)
    if r >= world_size:
        raise ValueError(f"rank={r} is out of range for world_size={world_size} (ranks 0..{world_size - 1})")
    return r


def even_slice(n: int, world_size: int, rank: int, what: str = "size") -> slice:
    """Rank ``rank``'s contiguous ``n / world_size`` share of ``range(n)`` (the columns of a
    column-parallel projection); ValueError unless ``world_size`` divides ``n`` and
    ``0 <= rank < world_size``."""
    n = _int(what, n, 1)
    P = _int("world_size", world_size, 1)
    rank = _rank(rank, P)
    if n % P:
        raise ValueError(f"{what}={n} is not divisible by world_size={P}: every rank takes an equal share")
    per = n // P
    return slice(rank * per, (rank + 1) * per)
