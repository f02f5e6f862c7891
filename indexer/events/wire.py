"""Decoding vLLM's KV-event frames (vllm-interface.md 1.2-1.8), defensively.

A message is ``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack
``[ts, events, data_parallel_rank]`` (a map ``{ts, events, data_parallel_rank}`` in one upstream revision).
Each event is a map tagged by ``"type"`` (this vLLM) or an array whose first element is the tag (older
vLLM). Hashes arrive as int, uint64 or bytes (the last 8 bytes, big endian, as vLLM and llm-d truncate).
Unknown keys and event types are ignored; a malformed event is counted in ``Batch.malformed`` and skipped;
a payload that is not a batch at all raises :class:`DecodeError` (the caller counts and drops it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

_MASK = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()

# Positional fields of the older array form, after the tag.
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class DecodeError(ValueError):
    """A frame or payload that is not a vLLM KV-event batch."""


# a KV cache group's index: the handle map packs it in 32 bits (indexer/index/redis.py); one outside is a
# malformed event (it made every save of the worker's map fail, and the source never synced again)
GroupIdx = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: GroupIdx = 0
    kv_cache_spec_kind: str | None = None
    locality: str | None = None  # offload tiers: "LOCAL" | "REMOTE" (relative to the publisher), or None
    ownership: str | None = None  # offload tiers: the secondary tier's id (vLLM's fs tier sends None)


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: GroupIdx = 0
    locality: str | None = None
    ownership: str | None = None  # "kvgate-g4": a G4 store eviction carrying kvgate hashes (docs/g4.md)


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    malformed: int = 0  # events that could not be decoded and were skipped
    ignored: int = 0  # events of unknown types


def norm_hash(h: Any) -> int:
    """An engine block hash as an unsigned 64-bit int (bytes: the last 8, big endian)."""
    if isinstance(h, bool):
        raise DecodeError("a block hash cannot be a bool")
    if isinstance(h, int):
        return h & _MASK
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise DecodeError("empty block hash")
        return int.from_bytes(b[-8:], "big")
    raise DecodeError(f"block hash of type {type(h).__name__}")


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise DecodeError("block_hashes is not a list")
    return [norm_hash(h) for h in v]


def _opt_str(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise DecodeError("expected a string")


def _opt_int(v: Any, default: int = 0) -> int:
    if v is None:
        return default
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise DecodeError("expected an int")


def _group(v: Any) -> int:
    g = _opt_int(v)
    if not 0 <= g < 1 << 32:
        raise DecodeError("group_idx out of range")
    return g


def _fields(ev: Any, names: tuple[str, ...]) -> tuple[str, dict]:
    if isinstance(ev, dict):
        tag = ev.get("type")
        return tag, ev
    if isinstance(ev, list) and ev:
        return ev[0], dict(zip(names, ev[1:]))
    raise DecodeError("an event is neither a map nor an array")


def _tag(ev: Any) -> Any:
    if isinstance(ev, dict):
        return ev.get("type")
    if isinstance(ev, list) and ev:
        return ev[0]
    raise DecodeError("an event is neither a map nor an array")


def decode_event(ev: Any) -> Event | None:
    """One event (map or array form); None for an unknown type."""
    tag = _tag(ev)
    if tag == "BlockStored":
        _, f = _fields(ev, _STORED_FIELDS)
        tokens = f.get("token_ids")
        if tokens is None:
            tokens = []
        if not isinstance(tokens, list):
            raise DecodeError("token_ids is not a list")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else norm_hash(parent),
            token_ids=tokens,
            block_size=_opt_int(f.get("block_size")),
            medium=_opt_str(f.get("medium")),
            lora_name=_opt_str(f.get("lora_name")),
            extra_keys=extra if isinstance(extra, list) else None,
            group_idx=_group(f.get("group_idx")),
            kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind")),
            locality=_opt_str(f.get("locality")),
            ownership=_opt_str(f.get("ownership")),
        )
    if tag == "BlockRemoved":
        _, f = _fields(ev, _REMOVED_FIELDS)
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_opt_str(f.get("medium")),
            group_idx=_group(f.get("group_idx")),
            locality=_opt_str(f.get("locality")),
            ownership=_opt_str(f.get("ownership")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise DecodeError("event without a type tag")
    return None


class _TypedBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# The common case (this vLLM: array batch, tagged map events, int hashes) decodes straight into the event
# structs in C; anything else (bytes hashes, array events, unknown types, odd values) takes the generic path.
_typed_decoder = msgspec.msgpack.Decoder(_TypedBatch)


def _fast(payload: bytes) -> Batch | None:
    try:
        b = _typed_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    for ev in b.events:
        if isinstance(ev, BlockStored):
            if ev.block_hashes and min(ev.block_hashes) < 0:
                ev.block_hashes = [h & _MASK for h in ev.block_hashes]
            if ev.parent_block_hash is not None and ev.parent_block_hash < 0:
                ev.parent_block_hash &= _MASK
        elif isinstance(ev, BlockRemoved) and ev.block_hashes and min(ev.block_hashes) < 0:
            ev.block_hashes = [h & _MASK for h in ev.block_hashes]
    return Batch(ts=b.ts, events=b.events, dp_rank=b.data_parallel_rank)


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload frame; raises :class:`DecodeError` when it is not a batch."""
    fast = _fast(payload)
    if fast is not None:
        return fast
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise DecodeError(f"not msgpack: {e}") from None
    except RecursionError:  # nested past msgspec's depth limit: no batch either (it escaped the counting)
        raise DecodeError("not a batch: nested too deeply") from None
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp = raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError("payload is not a [ts, events, dp_rank] batch")
    if not isinstance(events, list):
        raise DecodeError("batch events is not a list")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise DecodeError("batch ts is not a number")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool)):
        dp = None
    out: list[Event] = []
    malformed = ignored = 0
    for ev in events:
        try:
            e = decode_event(ev)
        except DecodeError:
            malformed += 1
            continue
        if e is None:
            ignored += 1
        else:
            out.append(e)
    return Batch(ts=float(ts), events=out, dp_rank=dp, malformed=malformed, ignored=ignored)


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number frame."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big")
