"""kvgate cache_tier: the G4 block store on a shared filesystem and kvgate's vLLM KV connector."""
