"""What the cupy backend takes from CuPy, in one object handed to the backend.

``CupyBackend`` never imports cupy itself: it asks its ``CupyRuntime`` for the array
module (``cp``: empty, zeros, full, asarray, ascontiguousarray, ndarray, dtypes, the
``cuda.Device`` context), for device facts, the current stream and the kernel launcher.
The default runtime imports cupy on first use (so importing gqakv never does) and
launches through ``modules.run_plan`` (NVRTC via ``cupy.RawModule``). The CPU emulation
(tests/cuda_emu/emulated_backend.py) builds one from its stand-in module and its
emulated launcher instead, so the backend's own code runs unchanged there and no
``sys.modules`` entry is ever swapped.
"""

from __future__ import annotations

import threading


class CupyRuntime:
    """CuPy (or a stand-in with the same few names) and a kernel launcher.

    cupy: the array module; None imports ``cupy`` on first use.
    launch: ``launch(plan, arrays, dtype, head_dim)`` running a ``plan.Plan``; None is
    ``modules.run_plan`` (compile with NVRTC, launch on the current device).
    """

    def __init__(self, cupy=None, launch=None):
        self._cp = cupy
        self._launch = launch
        self._bf16: bool | None = None
        self._lock = threading.Lock()

    @property
    def cp(self):
        """The array module (imported on first use)."""
        if self._cp is None:
            import cupy

            self._cp = cupy
        return self._cp

    @property
    def version(self) -> str:
        return str(self.cp.__version__)

    def device(self, device_id=None):
        """Context making device ``device_id`` current (None: the current one); ``.id``."""
        return self.cp.cuda.Device(device_id)

    def device_facts(self) -> tuple[int, int]:
        """(multiprocessors, compute capability as CuPy spells it, e.g. 90) of the current
        device."""
        dev = self.cp.cuda.Device()
        return int(dev.attributes["MultiProcessorCount"]), int(dev.compute_capability)

    def stream_ptr(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def run_plan(self, plan, arrays: dict, dtype: str, head_dim: int) -> None:
        """Launch every kernel of ``plan`` (``modules.run_plan``'s contract)."""
        if self._launch is not None:
            return self._launch(plan, arrays, dtype, head_dim)
        from .modules import run_plan

        return run_plan(plan, arrays, dtype, head_dim)

    def bf16_supported(self) -> bool:
        """Whether this CuPy holds ml_dtypes.bfloat16 arrays (CuPy 14+); asked once."""
        if self._bf16 is None:
            import ml_dtypes

            with self._lock:
                try:
                    self.cp.empty(1, dtype=ml_dtypes.bfloat16)
                    self._bf16 = True
                except Exception:
                    self._bf16 = False
        return self._bf16
