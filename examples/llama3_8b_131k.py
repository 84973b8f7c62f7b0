"""Llama 3 8B on sequences of 131,072 tokens (the zoo's model has rotary tables for 8,192):
a workload script for `simddp whatif` (docs/context-parallel.md)."""

from fakepg import zoo
from simddp.cosim.ring_attention import long_context

scenario = long_context(zoo.get("llama3-8b"), 131072)
