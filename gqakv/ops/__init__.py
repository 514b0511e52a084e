"""Operations on a store, written once against the array API: attention
(``attention``: ``gqa_attention`` and the generic implementation), merging partial results
(``merge``), writing K/V (``cache_ops``), row operations (``row_ops``) and the float64
reference (``reference``). Imports ``gqakv.core`` and ``gqakv.storage``."""
