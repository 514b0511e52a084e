"""asv benchmarks for gqakv (see asv_benchmarks/asv.conf.json and the README)."""
