"""The torch backend: gqakv's array-API core running on torch tensors (CPU or CUDA).

Nothing here imports torch until the backend is asked a question (``gqakv info``,
``backend="torch"``), so ``import gqakv`` stays torch-free.

Devices. ``KVCache(..., backend="torch")`` allocates where torch allocates by
default: the CPU, or whatever ``with torch.device("cuda"):`` /
``torch.set_default_device`` selects. To pin a device, pass an instance:
``KVCache(..., backend=TorchBackend(device="cuda:0"))``.

Priority. It is below numpy's, so 'auto' keeps picking numpy (for NumPy inputs) on a
CPU-only machine; choose torch explicitly (``backend="torch"``, ``use_backend("torch")``
or ``GQAKV_BACKEND=torch``) when your tensors are torch tensors.

DLPack, no copies. torch tensors and CuPy arrays on the same GPU, and torch CPU
tensors and NumPy arrays, exchange memory through DLPack: ``cupy.from_dlpack(t)``,
``torch.from_dlpack(cupy_array)``, ``numpy.from_dlpack(cpu_tensor)`` all return views
of the same buffer. So a cache filled through the torch backend can be read by the
CuPy backend's kernels (``cupy.from_dlpack(cache.k)``) and vice versa, without copying.
"""

from __future__ import annotations

import numpy as np

from gqakv.dispatch.backend import GENERIC, Backend
from gqakv.core.dtypes import canonical_name

INSTALL_HINT = "pip install torch==2.13.0 (CPU build) or a CUDA build from pytorch.org"


class TorchBackend(Backend):
    name = "torch"
    # Below numpy (10): 'auto' must not hand torch buffers to NumPy callers.
    priority = 5
    array_library = "torch"
    device_kind = "cpu, cuda"
    dtypes = ("float32", "float64", "float16", "bfloat16")
    head_dims = None
    features = frozenset({
        "array_api (via array_api_compat.torch)",
        "cuda where torch.cuda.is_available()",
        "dlpack zero-copy exchange (numpy on CPU, cupy on CUDA)",
        "float16/bfloat16 computed in float32",
        # no fused kernel of its own: every call, variants included, is the generic path
        "attention variants (window, softcap, sinks) on the generic array-API path",
    })
    packed_tokens = True  # the generic defaults (its write_kv wraps one) take [N, H, d] tokens
    wide_queries = True  # float32 q over a 16-bit store: computed and returned in float32
    generic_invariant = True  # on the CPU: equal operands and shapes give equal bits

    def __init__(self, device=None):
        """``device``: a torch device (or string) to allocate on; None follows torch's default."""
        self._device = device

    # -- availability --------------------------------------------------------------------

    def unavailable_reason(self):
        try:
            import torch
        except ImportError:
            return f"torch: not installed ({INSTALL_HINT})"
        except Exception as exc:  # a broken install says why, it does not crash gqakv
            return f"torch: failed to import ({type(exc).__name__}: {exc})"
        if self._device is not None:
            dev = torch.device(self._device)
            if dev.type == "cuda" and not torch.cuda.is_available():
                return f"torch: device {dev} requested but torch.cuda.is_available() is False"
        return None

    # -- hooks for the tools (gqakv.dispatch.backend.Backend) ----------------------------------------

    def for_device(self, device) -> "TorchBackend":
        """A torch backend that allocates on ``device`` (a torch device or string)."""
        return TorchBackend(device=device)

    def for_local_device(self, index: int) -> "TorchBackend":
        """``cuda:index`` when CUDA is available and no device was chosen, else this one."""
        import torch

        if self._device is None and torch.cuda.is_available():
            return TorchBackend(device=f"cuda:{int(index)}")
        return self

    def invariant_attention(self) -> frozenset[str]:
        """The generic code honours batch-invariant mode on the CPU only: a device chosen
        as ``cpu``, or none chosen on a torch without CUDA (GPU reductions were not shown
        to give equal bits for equal operands)."""
        import torch

        names = super().invariant_attention()
        on_cpu = (torch.device(self._device).type == "cpu" if self._device is not None
                  else not torch.cuda.is_available())
        return names if on_cpu else names - {GENERIC}

    def thread_count(self) -> int | None:
        """torch's intra-op threads on the CPU; None on CUDA."""
        import torch

        if self._device is not None and torch.device(self._device).type != "cpu":
            return None
        return int(torch.get_num_threads())

    # -- arrays --------------------------------------------------------------------------

    def namespace(self):
        import array_api_compat.torch as xp

        return xp

    def dtype(self, name: str):
        import torch

        return getattr(torch, canonical_name(name))

    def _target_device(self):
        import torch

        if self._device is not None:
            return torch.device(self._device)
        return torch.get_default_device()

    def empty(self, shape, dtype, device=None):
        """Uninitialized; MemoryError when the device cannot hold it (torch raises a
        RuntimeError on the CPU and torch.OutOfMemoryError on CUDA; the cache's
        allocation turns a MemoryError into one that names the size)."""
        import torch

        try:
            return torch.empty(shape, dtype=self.dtype(dtype), device=device or self._target_device())
        except RuntimeError as exc:
            text = str(exc)
            if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or (
                    "can't allocate memory" in text or "out of memory" in text):
                raise MemoryError(text.splitlines()[0] if text else type(exc).__name__) from None
            raise

    def owns(self, x) -> bool:
        import torch

        return isinstance(x, torch.Tensor)

    def device_of(self, x):
        return x.device

    def from_numpy(self, a, dtype=None):
        """A torch copy of the NumPy array ``a`` (never a view of it), optionally cast."""
        import torch

        a = np.asarray(a)
        if a.dtype.name == "bfloat16":  # ml_dtypes bfloat16: same bits as torch's
            t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        else:
            # torch refuses negative strides (a reversed view); a NumPy copy has none
            t = torch.tensor(a.copy() if any(s < 0 for s in a.strides) else a)
        if dtype is not None:
            t = t.to(self.dtype(dtype))
        return t.to(self._target_device())

    def to_numpy(self, x) -> np.ndarray:
        """The values of ``x`` as NumPy (a view for CPU tensors, a host copy for CUDA ones)."""
        import torch

        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()

    def from_host_ints(self, a, device=None):
        import torch

        return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)

    # -- hot operations ----------------------------------------------------------------------

    def write_kv(self, store, k_new, v_new, inputs) -> None:
        """The generic in-place write, outside autograd: the cache holds values, not a
        graph (a ``k_new`` that requires grad would otherwise chain every step's graph
        onto the buffer and keep it alive)."""
        import torch

        with torch.no_grad():
            super().write_kv(store, k_new, v_new, inputs)

    def copy_tokens(self, dst, dst_rows, src, src_rows, n_tokens) -> None:
        import torch

        with torch.no_grad():
            super().copy_tokens(dst, dst_rows, src, src_rows, n_tokens)

    # -- DLPack --------------------------------------------------------------------------

    @staticmethod
    def from_dlpack(x):
        """A torch tensor sharing memory with any DLPack producer (NumPy, CuPy, JAX, ...)."""
        import torch

        return torch.from_dlpack(x)

    def synchronize(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def __repr__(self) -> str:
        where = "" if self._device is None else f" on {self._device}"
        return f"<gqakv backend 'torch'{where}>"
