"""The floating-point dtypes gqakv knows, by name, independent of any array library."""

from __future__ import annotations

# Bytes per element of each cache dtype gqakv understands.
ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


#: Names already worked out, by dtype object (every append and attention call asks twice,
#: and NumPy's dtype.name is slow). Only the few dtype objects of real arrays end up here.
_NAMES: dict = {}


def canonical_name(dtype) -> str:
    """Name of a dtype given as a string or any library's dtype object.

    ``"float32"``, ``numpy.float32``, ``numpy.dtype("float32")``, ``cupy.float32``,
    ``torch.float32``, ``ml_dtypes.bfloat16`` and ``array_api_strict.float32`` all
    give ``"float32"`` (or ``"bfloat16"``, ...).
    """
    if isinstance(dtype, str):
        return _name_of(dtype)
    key = (type(dtype), dtype)  # the type first: dtypes of two libraries never compared
    try:
        return _NAMES[key]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = _name_of(dtype)
    try:
        _NAMES[key] = name
    except TypeError:
        pass
    return name


def _name_of(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        attr = getattr(dtype, "name", None)
        # numpy scalar types (np.float32), torch dtypes ("torch.float32") and
        # array_api_strict dtypes ("array_api_strict.float32") end in the name.
        name = attr if isinstance(attr, str) else getattr(dtype, "__name__", None) or str(dtype)
        name = name.rsplit(".", 1)[-1]
    name = name.lower()
    if name not in ITEMSIZE:
        raise TypeError(
            f"dtype {dtype!r} is not supported by gqakv (supported: {', '.join(ITEMSIZE)})"
        )
    return name


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a name or a dtype object of a float dtype; a
    codec's stored values: ``gqakv.storage.codecs``)."""
    return ITEMSIZE[canonical_name(dtype)]
