"""asv benchmarks for gqakv (see asv_benchmarks/asv.conf.json and docs/guides/performance.md, "Benchmarks (asv)")."""
