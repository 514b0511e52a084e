"""The caches users hold: ``KVCache`` (``cache``), ``PagedKVCache`` (``paged_cache``),
``ModelKVCache`` and its steps (``model_cache``), and the functional API over caller-owned
pages (``paged_functional``). Imports the layers below (core, storage, ops, dispatch)."""
