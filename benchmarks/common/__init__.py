"""Shared parts of the benchmark scripts: the workload, load clients, service control, result
records, report tables and plots (the scripts at the top of `benchmarks/` are what users run)."""
