"""The floor of gqakv: dtype names, the attention rules (``semantics``) and input
validation (``inputs``). Imports nothing else of gqakv."""
