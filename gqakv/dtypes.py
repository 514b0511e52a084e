"""The floating-point dtypes gqakv knows, by name, independent of any array library."""

from __future__ import annotations

# Bytes per element of each cache dtype gqakv understands.
ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


def canonical_name(dtype) -> str:
    """Name of a dtype given as a string or any library's dtype object.

    ``"float32"``, ``numpy.float32``, ``numpy.dtype("float32")``, ``cupy.float32``,
    ``torch.float32``, ``ml_dtypes.bfloat16`` and ``array_api_strict.float32`` all
    give ``"float32"`` (or ``"bfloat16"``, ...).
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        name = getattr(dtype, "name", None)
        if not isinstance(name, str):
            # numpy scalar types (np.float32), torch dtypes ("torch.float32") and
            # array_api_strict dtypes ("array_api_strict.float32") end in the name.
            name = getattr(dtype, "__name__", None) or str(dtype)
        name = name.rsplit(".", 1)[-1]
    name = name.lower()
    if name not in ITEMSIZE:
        raise TypeError(
            f"dtype {dtype!r} is not supported by gqakv (supported: {', '.join(ITEMSIZE)})"
        )
    return name


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a name or a dtype object)."""
    return ITEMSIZE[canonical_name(dtype)]
