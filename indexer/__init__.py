"""kvgate indexer: block identity, the global block index and vLLM KV event ingestion."""
