"""Examples that use gqakv the way a client would (not part of the core).

- ``gqakv_examples.llama``: a Llama-architecture decoder whose attention runs through
  a ``gqakv.ModelKVCache`` step (in-place K/V write + grouped-query attention per layer), with greedy chunked-prefill / ragged
  decode generation and an uncached full-forward reference.
- ``gqakv_examples.generate``: the ``gqakv generate`` subcommand (time to first token
  and tokens/s, cached vs re-running the full prefix each step).
"""
