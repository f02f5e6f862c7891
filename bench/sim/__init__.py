"""A simulated vLLM fleet: many workers in one process that speak vLLM's HTTP, metrics and KV-event formats,
with a prefix cache that behaves like vLLM's and a calibrated timing model (see docs/sim.md)."""
