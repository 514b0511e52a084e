"""The floating-point dtypes gqakv knows, by name, independent of any array library."""

from __future__ import annotations

# Bytes per element of each cache dtype gqakv understands.
ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


#: Quantized storage dtypes of K/V (a cache's ``kv_dtype``): bytes per stored value. Each
#: token also stores one float32 scale for K and one for V (``gqakv.storage.quantize``).
QUANTIZED_ITEMSIZE: dict[str, int] = {
    "int8": 1,
    "float8_e4m3fn": 1,
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
    """Bytes per element of ``dtype`` (a name or a dtype object; quantized names too)."""
    if isinstance(dtype, str) and dtype in QUANTIZED_ITEMSIZE:
        return QUANTIZED_ITEMSIZE[dtype]
    return ITEMSIZE[canonical_name(dtype)]


def kv_dtype_name(kv_dtype) -> str | None:
    """The canonical name of a ``kv_dtype`` argument: None (K/V stored as the cache's
    dtype), ``"int8"`` or ``"float8_e4m3fn"`` (a name, or a dtype object of that name such
    as ``numpy.int8``, ``torch.float8_e4m3fn``, ``ml_dtypes.float8_e4m3fn``)."""
    if kv_dtype is None:
        return None
    attr = getattr(kv_dtype, "name", None)
    name: str = kv_dtype if isinstance(kv_dtype, str) else (
        attr if isinstance(attr, str) else getattr(kv_dtype, "__name__", None) or str(kv_dtype))
    name = name.rsplit(".", 1)[-1].lower()
    if name not in QUANTIZED_ITEMSIZE:
        allowed = ", ".join(repr(n) for n in QUANTIZED_ITEMSIZE)
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported (allowed: None, {allowed})")
    return name
