"""Counting spies for tests that check how often the library calls something."""

from __future__ import annotations


def counting(monkeypatch, owner, name: str) -> list[str]:
    """Replace ``owner.name`` (a module's function or an object's method) with a wrapper
    that appends ``name`` to the returned list on each call, then calls the real one;
    undone with ``monkeypatch``."""
    calls: list[str] = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def kernel_layouts(monkeypatch) -> list[str]:
    """Spy on the numba kernels' ``attention_items``: the returned list gets the type name
    of each call's K layout (ndarray, Paged, Quantized, Grouped, ...); undone with
    ``monkeypatch``."""
    from gqakv_backends import numba_kernels as nk

    seen: list[str] = []
    real = nk.attention_items

    def spy(q, k_buf, v_buf, *rest):
        seen.append(type(k_buf).__name__)
        return real(q, k_buf, v_buf, *rest)

    monkeypatch.setattr(nk, "attention_items", spy)
    return seen
