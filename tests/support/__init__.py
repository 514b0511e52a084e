"""Shared test support. Test modules import from here, never from each other.

- ``reference``: the float64 loop reference (``reference_attention``; on padded buffers
  ``reference_on_buffers``), written from the definition, independent of gqakv.
- ``variants``: random attention variants (window, softcap, sinks) with their edge values.
- ``direct``: the direct model of a cache (``Direct`` one layer, ``DirectCache`` per layer)
  and the exact comparisons and snapshots against it.
- ``pages``: the page pool's accounting (``audit``).
- ``arrays``: NumPy test data into a backend's arrays and back (``BackendArrays``).
- ``quantization``: the 8-bit scheme's rule in NumPy, what a cache holds (``held``), the
  tokens that test the scheme.
- ``tolerance``: narrow-dtype tolerances derived from the reference and the held values.
- ``docs``: running a Markdown page's examples (Sybil).
- ``hf``: a tiny transformers Llama and greedy generation (needs torch and transformers).
- ``hot_ops``: a backend's hot operations on raw buffers.
- ``parity``, ``routes``: the product tests' tolerances by dtype and route checks.
The emulated CUDA harness (``tests/cuda_emu``, with its AddressSanitizer child runner
``harness.run_asan_child``) is a support package of its own.
"""
