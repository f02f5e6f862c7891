"""vLLM KV-event ingestion: wire decoding, per-worker hash mapping, ZMQ subscription, the ingestor."""
from indexer.events.ingestor import EventIngestor, EventSource
from indexer.events.subscriber import resolve_endpoint
from indexer.events.wire import Batch, DecodeError, decode_batch

__all__ = ["Batch", "DecodeError", "EventIngestor", "EventSource", "decode_batch", "resolve_endpoint"]
