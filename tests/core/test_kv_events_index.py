"""Pure parts of KV events: decoding both encodings, the chained hash, the exact index."""

from __future__ import annotations

import random

import msgspec
import pytest
from pydantic import ValidationError

from loadtest.engine.behaviours import kv_event_structs as ks
from proxy.config import BackendConfig
from proxy.config.kv_events import KvEventsEndpoint, for_rank
from proxy.core.exact_prefix import EngineIndex, Match, cached_tokens
from proxy.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvent,
    decode_batch,
    sequence_number,
    slices,
)
from proxy.core.prefix import block_hashes
from proxy.core.prefix_chain import ROOT, extend, extend_blocks

BS = 16
DOC = list(range(7_000, 7_000 + 8 * BS))


def stored(
    keys: list[int | bytes], parent: int | bytes | None, ids: list[int], medium: str = "GPU"
) -> BlockStored:
    return BlockStored(tuple(keys), parent, tuple(ids), BS, medium, False, 0)


@pytest.mark.parametrize("enc", ["map", "array", "batch_array"])
def test_both_encodings_decode_to_the_same_events(enc: ks.Encoding) -> None:
    payload = ks.batch_bytes(
        enc,
        [
            ks.stored(enc, [11, 12], None, DOC[: 2 * BS], BS),
            ks.removed(enc, [b"\x01" * 32], medium="CPU"),
            ks.cleared(enc),
        ],
        rank=3,
        ts=12.5,
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.rank == 3 and batch.skipped == 0
    assert batch.events == (
        BlockStored((11, 12), None, tuple(DOC[: 2 * BS]), BS, "GPU", False, 0),
        BlockRemoved((b"\x01" * 32,), "CPU", 0),
        AllBlocksCleared(),
    )


def test_the_oldest_array_batch_has_no_rank_and_its_events_no_medium() -> None:
    # vLLM's first release: [ts, events], BlockStored without medium or lora_name.
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [5], None, DOC[:BS], BS, None], ["BlockRemoved", [5]]]]
    )
    batch = decode_batch(payload)
    assert batch.rank is None
    assert batch.events == (
        BlockStored((5,), None, tuple(DOC[:BS]), BS, "GPU", False, 0),
        BlockRemoved((5,), "GPU", 0),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode({"ts": 1.0, "events": "no"}),
        msgspec.msgpack.encode([True, []]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
    ],
)
def test_malformed_batches_raise(payload: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_batch(payload)


def test_bad_and_unknown_events_are_skipped_not_fatal() -> None:
    events = [
        ["BlockStored", [1, 2], None, [1, 2, 3], BS, None, "GPU"],  # ids do not fill 2 blocks
        ["BlockStored", [1.5], None, DOC[:BS], BS, None, "GPU"],  # a float hash
        ["BlockStored", [b"x" * 65], None, DOC[:BS], BS, None, "GPU"],  # a huge hash
        ["BlockStored", [1], None, [-1] * BS, BS, None, "GPU"],  # negative ids
        ["BlockStored", [1], None, [0.5] * BS, BS, None, "GPU"],  # float ids
        ["BlockStored", [1], None, [2**63] * BS, BS, None, "GPU"],  # past 64 bits
        {"type": "SomethingNew", "x": 1},
        "not an event",
        ["BlockRemoved", [7], "GPU"],
    ]
    batch = decode_batch(msgspec.msgpack.encode([1.0, events]))
    assert batch.skipped == 8
    assert batch.events == (BlockRemoved((7,), "GPU", 0),)


def test_sequence_frames_are_big_endian_and_the_end_marker_is_minus_one() -> None:
    assert sequence_number((258).to_bytes(8, "big")) == 258
    assert sequence_number((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(MalformedEvent):
        sequence_number(b"\x00" * 4)


@pytest.mark.parametrize("block_tokens", [1, 7, 16, 32])
@pytest.mark.parametrize("engine_block", [5, 16, 32])
def test_the_chain_continued_block_by_block_equals_the_prompts_hashes(
    block_tokens: int, engine_block: int
) -> None:
    rng = random.Random(block_tokens * 100 + engine_block)
    ids = [rng.randrange(0, 200_000) for _ in range(engine_block * 23)]
    got: list[int] = []
    state = ROOT
    i = 0
    while i < 23:
        step = rng.choice([1, 2, 5])
        chunk = ids[i * engine_block : (i + step) * engine_block]
        blocks = extend_blocks(state, chunk, engine_block, block_tokens)
        got.extend(h for own, _ in blocks for h in own)
        state = blocks[-1][1]
        i += step
    assert got == block_hashes(ids, block_tokens)
    assert extend(ROOT, ids, block_tokens)[0] == block_hashes(ids, block_tokens)


def test_index_chains_children_and_applies_removals() -> None:
    index = EngineIndex(BS)
    want = block_hashes(DOC, BS)
    index.apply(stored([1, 2, 3], None, DOC[: 3 * BS]))
    index.apply(stored([4, 5], 3, DOC[3 * BS : 5 * BS]))
    assert index.match(want) == Match(5, 5)
    index.apply(BlockRemoved((3,), "GPU", 0))
    # Chained: without block 3 nothing after it is a cached prefix.
    assert index.match(want) == Match(2, 2)
    index.apply(AllBlocksCleared())
    assert index.match(want) == Match(0, 0) and index.blocks() == 0


def test_the_same_tokens_stored_twice_stay_cached_until_both_are_removed() -> None:
    # Two engine blocks with the same content (stored again under another engine hash, as
    # after a recompute): removing one leaves the other, and the prefix is still cached.
    index = EngineIndex(BS)
    want = block_hashes(DOC, BS)
    index.apply(stored([1, 2], None, DOC[: 2 * BS]))
    index.apply(stored([8, 9], None, DOC[: 2 * BS]))
    index.apply(BlockRemoved((1, 2), "GPU", 0))
    assert index.match(want) == Match(2, 2)
    index.apply(BlockRemoved((8, 9), "GPU", 0))
    assert index.match(want) == Match(0, 0)


def test_offloaded_blocks_count_but_weigh_less() -> None:
    index = EngineIndex(BS)
    want = block_hashes(DOC, BS)
    index.apply(stored([1, 2], None, DOC[: 2 * BS]))
    index.apply(stored([3, 4], 2, DOC[2 * BS : 4 * BS], medium="CPU"))
    got = index.match(want)
    assert got == Match(gpu_blocks=2, any_blocks=4)
    assert cached_tokens(got, BS, 0.5) == 2 * BS + 2 * BS // 2
    # Evicted from the GPU but kept on CPU: still a (cheaper) hit.
    index.apply(stored([1, 2], None, DOC[: 2 * BS], medium="CPU"))
    index.apply(BlockRemoved((1, 2), "GPU", 0))
    assert index.match(want) == Match(0, 4)


def test_orphans_lora_and_other_groups_are_not_indexed() -> None:
    index = EngineIndex(BS)
    index.apply(stored([9], 12345, DOC[:BS]))
    index.apply(BlockStored((1,), None, tuple(DOC[:BS]), BS, "GPU", True, 0))
    index.apply(BlockStored((2,), None, tuple(DOC[:BS]), BS, "GPU", False, 1))
    assert index.orphans == 1 and index.ignored == 2
    assert index.blocks() == 0


def test_memory_is_bounded_per_engine_oldest_first() -> None:
    index = EngineIndex(BS, max_blocks=3)
    index.apply(stored([1, 2, 3, 4, 5], None, DOC[: 5 * BS]))
    assert index.blocks() == 3
    assert index.match(block_hashes(DOC, BS)) == Match(0, 0)  # the head went first


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValidationError, match="exactly one of endpoint or port"):
        KvEventsEndpoint()
    with pytest.raises(ValidationError, match="endpoint"):
        KvEventsEndpoint(endpoint="http://nope")
    b = BackendConfig(
        name="a", url="http://10.0.0.7:8000", kv_events={"port": 5557, "replay_port": 5558}
    )  # type: ignore[arg-type]
    assert b.kv_events is not None
    assert b.kv_events.resolve("10.0.0.7") == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert for_rank("tcp://10.0.0.7:5557", 3) == "tcp://10.0.0.7:5560"
    assert for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_chat_rendered_the_servers_way_has_the_simulated_engines_ids() -> None:
    from loadtest.engine.behaviours.prefix_cache import prompt_blocks
    from proxy.config.kv_events import ChatRender
    from proxy.core.chain_hash import piece_of
    from proxy.core.prefix_prompt import PiecesCache, text_pieces
    from proxy.core.prefix_render import rendered_values
    from proxy.core.tokens import encoding

    messages = [
        {"role": "system", "content": "a long shared document " * 40},
        {"role": "user", "content": [{"type": "text", "text": "what does it say?"}]},
    ]
    _hashes, engine_ids = prompt_blocks({"messages": messages}, BS)
    encode = text_pieces(encoding())
    assert encode is not None
    ours = rendered_values(messages, ChatRender(), "cl100k", encode, PiecesCache())
    # Equal running values mean equal ids (each value is the one before times B plus the id's mix).
    assert len(engine_ids) > 0
    assert ours[: len(engine_ids)].tolist() == piece_of(engine_ids).tolist()
    with pytest.raises(ValidationError, match="content"):
        ChatRender(message="<|{role}|>")


def test_discovery_gives_every_backend_its_kv_event_ports_on_its_own_host() -> None:
    from proxy.backends.discovery import backend
    from proxy.config import DiscoveryConfig

    d = DiscoveryConfig(type="dns", name="vllm.svc", kv_events={"port": 5557, "replay_port": 5600})  # type: ignore[arg-type]
    b = backend(d, "pod-a", "10.1.2.3", 8000)
    assert b.kv_events is not None
    assert b.kv_events.resolve(b.url.host or "") == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5600")


@pytest.mark.parametrize("piece", [1, 3, 7, 64])
def test_an_event_applied_in_pieces_leaves_the_index_as_the_whole_event(piece: int) -> None:
    rng = random.Random(piece)
    whole, sliced = EngineIndex(BS), EngineIndex(BS)
    docs: list[list[int]] = []
    for d in range(6):
        n = rng.randrange(1, 40)
        ids = [rng.randrange(50_000) for _ in range(n * BS)]
        keys: list[int | bytes] = [d * 1_000 + i for i in range(n)]
        docs.append(ids)
        events: list[BlockStored | BlockRemoved] = [stored(keys, None, ids)]
        if d % 2:
            # Some of its tail evicted again, as an engine frees a request's blocks tail first.
            events.append(BlockRemoved(tuple(keys[n // 2 :]), "GPU", 0))
        for ev in events:
            whole.apply(ev)
            pieces = slices(ev, piece)
            assert len(pieces) == -(-len(ev.block_hashes) // piece)
            for p in pieces:
                assert len(p.block_hashes) <= piece  # type: ignore[union-attr]
                sliced.apply(p)
    assert sliced.blocks() == whole.blocks() and sliced.hashes() == whole.hashes()
    for ids in docs:
        hashes = block_hashes(ids, BS)
        assert sliced.match(hashes) == whole.match(hashes)


def test_a_piece_continues_the_chain_from_the_previous_pieces_last_block() -> None:
    ev = stored([1, 2, 3, 4, 5], 99, DOC[: 5 * BS])
    a, b, c = slices(ev, 2)
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored) and isinstance(c, BlockStored)
    assert (a.parent, b.parent, c.parent) == (99, 2, 4)
    assert b.token_ids == tuple(DOC[2 * BS : 4 * BS]) and c.block_hashes == (5,)
    assert slices(AllBlocksCleared(), 1) == [AllBlocksCleared()]
    with pytest.raises(ValueError):
        slices(ev, 0)
