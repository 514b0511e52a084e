"""Finding backends and choosing one.

Backends come from the entry-point group ``gqakv.backends`` (the built-in ones
register there too) and from ``register_backend`` at run time. Plugins are loaded
lazily, on the first question about backends, never when gqakv is imported; a
plugin that fails to load is a warning, not a crash.

Choice, first match wins:
  1. an explicit ``backend=`` argument: a name or a Backend; never falls back, it
     raises the reason the backend cannot serve the request;
  2. the innermost ``use_backend(...)`` block (a ContextVar: per thread and task);
  3. the ``GQAKV_BACKEND`` environment variable;
  4. 'auto': the highest-priority backend that can run and supports the request.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from importlib.metadata import entry_points

from .backend import Backend

ENTRY_POINT_GROUP = "gqakv.backends"
ENV_VAR = "GQAKV_BACKEND"


class BackendError(RuntimeError):
    """The requested backend does not exist, cannot run here, or cannot serve the request."""


_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False
_scoped: contextvars.ContextVar[str | Backend | None] = contextvars.ContextVar(
    "gqakv_backend", default=None
)


def _instantiate(obj) -> Backend:
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"expected a gqakv.Backend subclass or instance, got {obj!r}")
    return backend


def _load_plugins() -> None:
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _backends:  # registered at run time first: that one wins
                continue
            try:
                backend = _instantiate(ep.load())
            except Exception as exc:  # a broken plugin must not break gqakv
                _plugin_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"gqakv: backend plugin {ep.name!r} ({ep.value}) failed to load: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            _backends.setdefault(backend.name, backend)


def register_backend(backend, *, replace: bool = False) -> Backend:
    """Add a backend (a Backend subclass or instance) at run time; returns the instance."""
    backend = _instantiate(backend)
    with _lock:
        _load_plugins()
        if backend.name in _backends and not replace:
            raise ValueError(
                f"a backend named {backend.name!r} is already registered; pass replace=True"
            )
        _backends[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend added by name (mostly for tests)."""
    with _lock:
        _load_plugins()
        _backends.pop(name, None)


def list_backends() -> list[Backend]:
    """Every registered backend, highest priority first (runnable or not)."""
    _load_plugins()
    with _lock:
        return sorted(_backends.values(), key=lambda b: (-b.priority, b.name))


def plugin_errors() -> dict[str, str]:
    """Entry points that failed to load, with the error each raised."""
    _load_plugins()
    return dict(_plugin_errors)


def _lookup(name: str, source: str | None = None) -> Backend:
    _load_plugins()
    with _lock:
        backend = _backends.get(name)
    if backend is None:
        known = ", ".join(b.name for b in list_backends()) or "none"
        broken = f"; failed to load: {_plugin_errors[name]}" if name in _plugin_errors else ""
        where = f", chosen by {source}" if source else ""
        raise BackendError(f"unknown backend {name!r}{where} (registered: {known}){broken}")
    return backend


@contextlib.contextmanager
def use_backend(backend):
    """Use ``backend`` (a name, a Backend, or 'auto') for caches created inside the block."""
    if not isinstance(backend, (str, Backend)):
        raise TypeError(f"use_backend expects a backend name or Backend, got {backend!r}")
    if isinstance(backend, str) and backend != "auto":
        _lookup(backend)  # fail at the with statement, not later
    token = _scoped.set(backend)
    try:
        yield
    finally:
        _scoped.reset(token)


def _requested() -> tuple[str | Backend, str]:
    """The backend asked for by context or environment, and where it came from."""
    scoped = _scoped.get()
    if scoped is not None:
        return scoped, "use_backend()"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    return "auto", "auto"


def get_backend(backend=None, *, dtype=None, head_dim: int | None = None) -> Backend:
    """The backend to use for a cache of ``dtype`` and ``head_dim``.

    ``backend`` is a name, a Backend instance, 'auto' or None (then the scoped
    choice, then ``GQAKV_BACKEND``, then 'auto'). A named backend that cannot run or
    cannot serve the request raises BackendError with the reason; it never falls back.
    """
    if backend is None:
        backend, source = _requested()
    else:
        source = "backend="
    if isinstance(backend, str) and backend != "auto":
        backend = _lookup(backend, source if source != "backend=" else None)
    if isinstance(backend, Backend):
        reasons = backend.not_supported_reasons(dtype=dtype, head_dim=head_dim)
        if reasons:
            raise BackendError(
                f"backend {backend.name!r} (chosen by {source}) cannot serve this request: "
                + "; ".join(reasons)
            )
        return backend
    if backend != "auto":
        raise TypeError(f"backend must be a name, a Backend or None, got {backend!r}")
    rejections = []
    for candidate in list_backends():
        reasons = candidate.not_supported_reasons(dtype=dtype, head_dim=head_dim)
        if not reasons:
            return candidate
        rejections.append(f"  {candidate.name}: " + "; ".join(reasons))
    raise BackendError(
        f"no backend can serve dtype={dtype}, head_dim={head_dim}:\n" + "\n".join(rejections)
    )


def describe_backends() -> list[dict]:
    """One row per backend for ``gqakv info``: name, priority, runnable, reason, capabilities."""
    rows = []
    for b in list_backends():
        why = b.unavailable_reason()
        rows.append(
            {
                "name": b.name,
                "priority": b.priority,
                "available": why is None,
                "reason": why or "",
                "array_library": b.array_library,
                "device": b.device_kind,
                "dtypes": list(b.dtypes),
                "head_dims": "any" if b.head_dims is None else list(b.head_dims),
                "features": sorted(b.features),
            }
        )
    for name, err in sorted(plugin_errors().items()):
        rows.append(
            {"name": name, "priority": None, "available": False,
             "reason": f"plugin failed to load: {err}", "array_library": "?", "device": "?",
             "dtypes": [], "head_dims": [], "features": []}
        )
    return rows
