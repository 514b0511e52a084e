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
