"""vLLM's KV-cache event messages -> plain values, both encodings vLLM has shipped.

What vLLM publishes (``vllm/distributed/kv_events.py``), read across its releases:

* A ZeroMQ multipart message per batch: ``topic``, the sequence number as 8 bytes big-endian
  (a per-publisher counter from 0, so it restarts with the engine), and a msgpack payload.
* The payload is an ``EventBatch``: ``ts``, ``events`` and, since data parallelism was
  added, ``data_parallel_rank``. Older releases encode structs as arrays
  (``array_like=True``): ``[ts, events]`` or ``[ts, events, rank]``; newer ones as maps
  (``{"ts": ..., "events": [...], "data_parallel_rank": ...}``, a ``None`` rank omitted).
* Each event is a tagged union (``tag=True``): an array whose first item is the class name
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, ...]``, fields appended over releases) or a map with a ``type`` key.
* ``BlockStored``: ``block_hashes`` (an int in older releases, bytes in newer: vLLM's
  ``ExternalBlockHash``), ``parent_block_hash`` (None at a prompt's start), ``token_ids``
  of all the new blocks, ``block_size``, ``lora_id``/``lora_name``, ``medium`` ("GPU",
  or an offload tier such as "CPU"; None in older releases means GPU), ``group_idx``
  (KV-cache group of hybrid models). ``BlockRemoved``: ``block_hashes``, ``medium``,
  ``group_idx``. ``AllBlocksCleared``: no fields (a prefix-cache reset).

Decoding is generic msgpack (msgspec) then a hand check of every field, so one decoder takes
both encodings and a malformed or hostile message raises ``MalformedEvent`` (counted and
skipped by the subscriber) instead of reaching the index. Events of a kind this module does
not know are skipped, not errors: vLLM may add kinds.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec
import numpy as np

#: An engine's name for a block: an int (older vLLM) or bytes (a digest, newer vLLM).
BlockKey = int | bytes

MEDIUM_GPU = "GPU"
#: Bounds against hostile messages: more than this is refused, not allocated.
MAX_EVENTS_PER_BATCH = 100_000
MAX_BLOCKS_PER_EVENT = 65_536
MAX_KEY_BYTES = 64
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedEvent(ValueError):
    """A message that is not a KV-event batch as vLLM encodes it."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockKey, ...]
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    #: A LoRA adapter's blocks (lora_id or lora_name set): not the base model's prefix.
    lora: bool
    group: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockKey, ...]
    medium: str
    group: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    rank: int | None
    #: Events of kinds not known here, or stored/removed events whose fields were malformed.
    skipped: int = 0


_decoder = msgspec.msgpack.Decoder()


def slices(event: Event, max_blocks: int) -> list[Event]:
    """``event`` as pieces of at most ``max_blocks`` blocks, applied one after the other.

    A store of a long prompt (2,000 blocks: ~3 ms to apply) becomes a chain of stores, each
    piece's parent the previous piece's last block, so that the feed can let requests run
    between pieces; applied in order, the pieces leave an index exactly as the whole event.
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be positive, got {max_blocks}")
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= max_blocks:
        return [event]
    keys = event.block_hashes
    n = len(keys)
    if isinstance(event, BlockRemoved):
        return [
            BlockRemoved(keys[i : i + max_blocks], event.medium, event.group)
            for i in range(0, n, max_blocks)
        ]
    assert isinstance(event, BlockStored)
    size = event.block_size
    out: list[Event] = []
    parent = event.parent
    for i in range(0, n, max_blocks):
        piece = keys[i : i + max_blocks]
        ids = event.token_ids[i * size : (i + len(piece)) * size]
        out.append(BlockStored(piece, parent, ids, size, event.medium, event.lora, event.group))
        parent = piece[-1]
    return out


def decode_batch(payload: bytes) -> EventBatch:
    """One batch's payload (either encoding) -> ``EventBatch``; ``MalformedEvent`` if it is not one."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise MalformedEvent(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise MalformedEvent("a batch is [ts, events(, rank)] or a map with ts and events")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise MalformedEvent("batch ts is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise MalformedEvent("batch events is not a list (or is too long)")
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise MalformedEvent("data_parallel_rank is not a non-negative integer")
    out: list[Event] = []
    skipped = 0
    for item in events:
        try:
            event = decode_event(item)
        except MalformedEvent:
            event = None
        if event is None:
            skipped += 1
        else:
            out.append(event)
    return EventBatch(float(ts), tuple(out), rank, skipped)


def decode_event(item: Any) -> Event | None:
    """One event, tagged array or tagged map; None for a kind not known here."""
    tag, fields = _untag(item)
    if tag == "BlockStored":
        return _stored(_named(fields, _STORED_FIELDS))
    if tag == "BlockRemoved":
        got = _named(fields, _REMOVED_FIELDS)
        return BlockRemoved(_keys(got.get("block_hashes")), _medium(got), _group(got))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _untag(item: Any) -> tuple[str, dict[str, Any] | list[Any]]:
    if isinstance(item, list) and item and isinstance(item[0], str):
        return item[0], item[1:]
    if isinstance(item, dict) and isinstance(item.get("type"), str):
        return item["type"], item
    raise MalformedEvent("an event is a tagged array or a map with a 'type'")


def _named(fields: dict[str, Any] | list[Any], names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(fields, dict):
        return fields
    return dict(zip(names, fields, strict=False))


def _stored(got: dict[str, Any]) -> BlockStored:
    keys = _keys(got.get("block_hashes"))
    parent = got.get("parent_block_hash")
    if parent is not None:
        parent = _key(parent)
    ids = got.get("token_ids")
    size = got.get("block_size")
    if not _is_int(size) or size < 1:
        raise MalformedEvent("block_size is not a positive integer")
    if not isinstance(ids, list) or len(ids) != len(keys) * size:
        raise MalformedEvent("token_ids do not fill the stored blocks")
    if not _token_ids(ids):
        raise MalformedEvent("token_ids are not non-negative integers")
    lora = got.get("lora_id") is not None or got.get("lora_name") is not None
    return BlockStored(keys, parent, tuple(ids), size, _medium(got), lora, _group(got))


def _keys(value: Any) -> tuple[BlockKey, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_BLOCKS_PER_EVENT:
        raise MalformedEvent("block_hashes is not a non-empty list (or is too long)")
    kinds = set(map(type, value))
    if kinds == {int}:
        # Every key a plain int (bool is its own type): the common case, checked at C speed.
        return tuple(value)
    if kinds == {bytes} and max(map(len, value)) <= MAX_KEY_BYTES and min(map(len, value)) > 0:
        return tuple(value)
    return tuple(_key(v) for v in value)


def _key(value: Any) -> BlockKey:
    if _is_int(value):
        return int(value)
    if isinstance(value, bytes) and 0 < len(value) <= MAX_KEY_BYTES:
        return value
    raise MalformedEvent("a block hash is neither an integer nor a short byte string")


def _medium(got: dict[str, Any]) -> str:
    medium = got.get("medium")
    if medium is None:
        return MEDIUM_GPU
    if not isinstance(medium, str) or len(medium) > 32:
        raise MalformedEvent("medium is not a short string")
    return medium.upper()


def _group(got: dict[str, Any]) -> int:
    group = got.get("group_idx")
    if group is None:
        return 0
    if not _is_int(group) or group < 0:
        raise MalformedEvent("group_idx is not a non-negative integer")
    return int(group)


def _token_ids(ids: list[Any]) -> bool:
    """Non-negative 64-bit integers, checked in one numpy pass (a 32k-token store: ~1 ms, not
    ~30 ms of a Python loop on the event loop). numpy infers int64 only for a list of ints
    that fit; floats, strings, bools alone or values past 2**63 give another dtype."""
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):
        return False
    return arr.dtype == np.int64 and arr.ndim == 1 and not bool((arr < 0).any())


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def sequence_number(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame; signed, so the replay's end marker reads -1."""
    if len(frame) != 8:
        raise MalformedEvent("the sequence frame is not 8 bytes")
    return int.from_bytes(frame, "big", signed=True)
