"""gqakv's built-in backend plugins (installed as ``gqakv_backends``).

Each module here is registered through the ``gqakv.backends`` entry-point group in
pyproject.toml, exactly as a third-party plugin would be. Modules import their array
library lazily, so loading a plugin never imports CuPy or torch.
"""
