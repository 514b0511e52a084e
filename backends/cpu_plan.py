"""Work planning shared by the CPU backends (numpy, numba): threads and work items.

A call's queries are cut into independent *items* ``(i, h0, h1, t0, t1, j0, j1, cost)``
(batch entry i, KV heads h0:h1, queries t0:t1, keys j0:j1) of about equal cost,
which the backends hand out to their threads in consecutive runs. Key pieces of one
row and query block (an item that does not cover every key its queries see) are
merged afterwards through their log-sum-exp.

``_threads`` sizes the worker count (GQAKV_NUM_THREADS, else BLAS's thread count)
and holds BLAS to one thread while the backend's own threads work, so the two levels
of threading never fight over the cores.
"""

from __future__ import annotations

import math
import os

from gqakv.core.semantics import AttentionParams, block_keys, common_keys
import threading
from concurrent.futures import ThreadPoolExecutor

# Items per worker the planner aims for, so uneven items still balance.
ITEMS_PER_WORKER = 4

ENV_THREADS = "GQAKV_NUM_THREADS"
# Query tiles of at most this many rows (decode: G rows) are "thin": on OpenBLAS's
# AVX-512 kernels (SkylakeX and later) K @ q^T runs about twice as fast as q @ K^T for
# them; on the others (Haswell, Zen) q @ K^T is the fast one.
THIN_QUERIES = 16
K_MAJOR_KERNELS = ("skylakex", "cooperlake", "sapphirerapids")


# -- threads -------------------------------------------------------------------------------

class _Threads:
    """A shared worker pool and a guard that holds BLAS to one thread while it works."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._blas = None  # threadpoolctl controller of the BLAS libraries, False if absent
        self._depth = 0  # calls currently holding BLAS to one thread
        self._saved: list[int] = []
        self._k_major: bool | None = None
        # A forked child inherits the pool object but not its threads: start afresh there.
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self):
        self._lock = threading.Lock()
        self._pool, self._pool_size, self._depth = None, 0, 0

    def _blas_controller(self):
        if self._blas is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:
                self._blas = False
            else:
                self._blas = ThreadpoolController().select(user_api="blas")
        return self._blas

    def default_workers(self) -> int:
        """GQAKV_NUM_THREADS if set, else as many threads as BLAS would use (1 without threadpoolctl)."""
        env = os.environ.get(ENV_THREADS)
        if env:
            try:
                n = int(env)
            except ValueError:
                raise ValueError(f"{ENV_THREADS}={env!r} is not an integer") from None
            if n < 1:
                raise ValueError(f"{ENV_THREADS}={n} must be >= 1")
            return n
        blas = self._blas_controller()
        if not blas or not blas.lib_controllers:
            return 1  # without threadpoolctl BLAS cannot be held to one thread: let it thread
        with self._lock:
            if self._depth:
                return max(self._saved)
            return max(1, max(c.num_threads for c in blas.lib_controllers))

    def k_major_scores(self) -> bool:
        """Whether thin score tiles should be computed as K @ q^T (see THIN_QUERIES)."""
        if self._k_major is None:
            blas = self._blas_controller()
            arch = [str(c.architecture).lower() for c in blas.lib_controllers
                    if hasattr(c, "architecture")] if blas else []
            self._k_major = bool(arch) and all(a in K_MAJOR_KERNELS for a in arch)
        return self._k_major

    def pool(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_size < workers:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gqakv")
                self._pool_size = workers
            return self._pool

    def __enter__(self):
        blas = self._blas_controller()
        if blas:
            with self._lock:
                if self._depth == 0:
                    self._saved = [c.num_threads for c in blas.lib_controllers]
                    for c in blas.lib_controllers:
                        c.set_num_threads(1)
                self._depth += 1
        return self

    def __exit__(self, *exc):
        blas = self._blas_controller()
        if blas:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for c, n in zip(blas.lib_controllers, self._saved):
                        c.set_num_threads(n)
        return False


_threads = _Threads()


#: OpenBLAS's setting (read once, when the library loads) of how long its idle worker
#: threads spin before they sleep: 2**n time-stamp ticks, n from 4 to 30 (default 28:
#: about 0.1 s at 2.5 GHz).
OPENBLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"


def blas_spin_note() -> str | None:
    """Advice for a process whose BLAS keeps idle threads spinning, else None.

    OpenBLAS's pthreads build (NumPy's wheels) keeps its worker threads spinning for
    about 0.1 s after every threaded call. In a model whose own matmuls run on it,
    those workers are still spinning when attention starts, and take a core from this
    backend's threads (the BLAS path's workers, the numba kernels' OpenMP threads):
    in SmolLM2-135M's prefill its attention ran 1.6-1.8x slower (performance guide,
    "Threads shared with the model's BLAS"). ``OPENBLAS_THREAD_TIMEOUT=4`` in the
    environment before NumPy is imported makes them sleep at once, which made the whole
    model faster on one machine and slower on another; it is the process's setting, so
    gqakv only says so."""
    spinning = _spinning_blas()
    if not spinning:
        return None
    return (f"OpenBLAS ({spinning[0].num_threads} threads, pthreads) keeps its workers spinning "
            "for about 0.1 s after each threaded call; where the process runs its own matmuls "
            "between attention calls (a model) they take a core from this backend's threads: "
            f"set {OPENBLAS_TIMEOUT_ENV}=4 before NumPy loads (the performance guide, "
            "\"Threads shared with the model's BLAS\")")


def _spinning_blas() -> list:
    """The BLAS libraries of this process whose idle threads spin (``blas_spin_note``)."""
    if os.environ.get(OPENBLAS_TIMEOUT_ENV):
        return []
    blas = _threads._blas_controller()  # the controller the BLAS guard holds (no new scan)
    return [c for c in (blas.lib_controllers if blas else [])
            if c.internal_api == "openblas" and getattr(c, "threading_layer", None) == "pthreads"
            and c.num_threads > 1]


def blas_spins() -> bool:
    """Whether a threaded BLAS call of this process leaves its workers spinning (OpenBLAS's
    pthreads build on more than one thread, ``OPENBLAS_THREAD_TIMEOUT`` unset)."""
    return bool(_spinning_blas())


def blas_workers() -> int:
    """GQAKV_NUM_THREADS if set, else as many threads as BLAS uses now (1 without
    threadpoolctl): what a kernel that stands in for a BLAS call should use."""
    return _threads.default_workers()


# -- planning ------------------------------------------------------------------------------

_CAUSAL = AttentionParams(scale=1.0)  # the key ranges of plain causal attention (scale unused)


#: The key-split minimum of batch-invariant plans: it splits nothing (a query's keys are
#: folded in one piece, in key order, whatever the thread count).
INVARIANT_NO_SPLIT = 1 << 62


def _plan(lens, n_new, Hkv: int, G: int, workers: int, query_block: int, min_key_split: int,
          params: AttentionParams = _CAUSAL, one_head: bool = False, trees=None,
          max_tile_rows: int | None = None, keys_first: bool = False,
          parallel_min_work: int = 0):
    """Cut the call into items ``(i, h0, h1, t0, t1, j0, j1)``.

    A query block reads the keys some query of it sees (``semantics.block_keys``); it is
    cut into key pieces only inside the keys every query of it sees
    (``semantics.common_keys``), so no piece is all masked for a query, and the pieces
    are merged through their log-sum-exp (``SoftmaxState.merge``, exact either way).
    ``one_head``: every item covers one KV head (the NumPy path's batch-invariant mode, whose
    block sizes must not depend on how many heads an item holds). ``trees``: None, or
    entry i -> its draft tree (``AttentionInputs.entry_tree``): key spans by the tree
    rule, cuts only inside the prefix every query sees. ``max_tile_rows``: at most this
    many query rows (KV heads x G x queries) per item, the heads split further if needed,
    down to one KV head per item (whose G x queries rows may be more; None: no limit).
    ``keys_first``: a task is cut into key pieces before its heads are (paged storage,
    whose pages hold every KV head: an item over all heads of a key range reads each page
    whole, in address order); by default heads are cut first (no merge).
    ``parallel_min_work``: a call of less work (the returned total) is cut for one
    worker, whatever ``workers`` (the caller runs it on one).
    """
    tasks = []  # (i, t0, t1, lo, hi, common_hi, cost)
    for i in range(len(n_new)):
        n, L = int(n_new[i]), int(lens[i])
        for t0 in range(0, n, query_block):
            t1 = min(n, t0 + query_block)
            tree = None if trees is None else trees(i)
            lo, hi = block_keys(params, L, n, t0, t1, tree)
            c_lo, c_hi = common_keys(params, L, n, t0, t1, tree)
            c_hi = max(lo, min(c_hi, hi)) if c_lo <= lo else lo  # cut points in lo..c_hi
            tasks.append((i, t0, t1, lo, hi, c_hi, Hkv * G * (t1 - t0) * (hi - lo)))
    total = sum(t[-1] for t in tasks)
    parallel = workers > 1 and total >= parallel_min_work
    target = total / (workers * ITEMS_PER_WORKER) if parallel else math.inf
    items = []
    for i, t0, t1, lo, hi, c_hi, cost in tasks:
        least_heads = Hkv if one_head else 1  # the fewest head parts allowed
        if max_tile_rows is not None:
            heads_per_item = max(1, max_tile_rows // (G * (t1 - t0)))
            least_heads = max(least_heads, math.ceil(Hkv / heads_per_item))  # parts of <= that many
        # Keys are cut only inside lo..c_hi (seen by every query of the block).
        key_room = (c_hi - lo) // min_key_split
        if keys_first:
            key_parts = max(1, min(math.ceil(cost / least_heads / target), key_room))
            head_parts = max(least_heads, min(Hkv, math.ceil(cost / key_parts / target)))
        else:
            head_parts = max(least_heads, min(Hkv, max(1, math.ceil(cost / target))))
            key_parts = max(1, min(math.ceil(cost / head_parts / target), key_room))
        bounds = [lo] + [lo + (c_hi - lo) * p // key_parts for p in range(1, key_parts)] + [hi]
        for hp in range(head_parts):
            h0, h1 = Hkv * hp // head_parts, Hkv * (hp + 1) // head_parts
            for kp in range(key_parts):
                items.append((i, h0, h1, t0, t1, bounds[kp], bounds[kp + 1],
                              (h1 - h0) * G * (t1 - t0) * (bounds[kp + 1] - bounds[kp])))
    return items, total


def _share(items, workers: int):
    """Split the item list into ``workers`` consecutive runs of about equal cost."""
    total = sum(it[-1] for it in items)
    runs: list[list[tuple]] = []
    run: list[tuple] = []
    acc = 0.0
    for it in items:
        run.append(it)
        acc += it[-1]
        if acc >= total * (len(runs) + 1) / workers and len(runs) < workers - 1:
            runs.append(run)
            run = []
    runs.append(run)
    return [r for r in runs if r]
