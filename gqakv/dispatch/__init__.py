"""Backends: the ``Backend`` base class and its routes (``backend``), and the registry
that loads plugins from the ``gqakv.backends`` entry-point group and chooses one
(``registry``). Imports ``gqakv.core``, ``gqakv.storage`` and ``gqakv.ops``."""
