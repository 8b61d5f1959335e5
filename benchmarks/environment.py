"""Moved to `benchmarks.common.environment`; kept only while `vllm_encoder_bench.py` imports it from here."""

from benchmarks.common.environment import environment  # noqa: F401
