"""K/V storage: the storage spec and store (``store``), the 8-bit codecs (``quantize``),
the page table and paged store (``paged``), and what a model's cache takes in bytes
(``sizing``). Imports only ``gqakv.core``."""
