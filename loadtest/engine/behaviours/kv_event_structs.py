"""vLLM's KV-cache event structs, in both encodings it has shipped, for our publishers.

Mirrors the shapes of ``vllm/distributed/kv_events.py`` (written here, not copied): older
releases declare every struct ``array_like=True`` (a batch is ``[ts, events, rank]``, an
event a tagged array ``["BlockStored", ...]``); newer ones drop ``array_like`` (maps, the tag
under ``type``); vLLM 0.28 has the batch an array and its events maps. Fields keep vLLM's order, since the array encoding is positional. The
simulated engine publishes with these, and the protocol tests build their bytes with them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

#: ``array``: every struct an array (older vLLM); ``batch_array``: the batch an array, each
#: event a tagged map (vLLM 0.28, what vllm-router 0.1.17 decodes); ``map``: all maps (newer).
Encoding = Literal["map", "array", "batch_array"]
ExternalBlockHash = int | bytes


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


_encoder = msgspec.msgpack.Encoder()


def stored(
    encoding: Encoding,
    block_hashes: list[ExternalBlockHash],
    parent: ExternalBlockHash | None,
    token_ids: list[int],
    block_size: int,
    medium: str | None = "GPU",
) -> msgspec.Struct:
    if encoding == "array":
        return ArrayBlockStored(block_hashes, parent, token_ids, block_size, None, medium)
    return MapBlockStored(block_hashes, parent, token_ids, block_size, None, medium, None)


def removed(
    encoding: Encoding, block_hashes: list[ExternalBlockHash], medium: str | None = "GPU"
) -> msgspec.Struct:
    if encoding == "array":
        return ArrayBlockRemoved(block_hashes, medium)
    return MapBlockRemoved(block_hashes, medium)


def cleared(encoding: Encoding) -> msgspec.Struct:
    return ArrayAllBlocksCleared() if encoding == "array" else MapAllBlocksCleared()


def batch_bytes(
    encoding: Encoding, events: list[msgspec.Struct], rank: int | None = None, ts: float = 0.0
) -> bytes:
    """One batch's payload, as vLLM's publisher encodes it."""
    cls = MapBatch if encoding == "map" else ArrayBatch
    return _encoder.encode(cls(ts, list(events), rank))
