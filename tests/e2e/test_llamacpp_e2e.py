"""Through the real gateway, in front of real llama.cpp servers running a real model.

Three ``llama-server`` processes (SmolLM2-135M, one thread each, ``tests/support/llama_servers``):

* ``u``: one unified pool, ``-c 1024 -np 4 --kv-unified`` (four slots, each of 1,024, over
  1,024 cells in all);
* ``p1``: partitioned, ``-c 2048 -np 2`` (two slots of 1,024);
* ``p2``: partitioned, ``-c 2048 -np 4`` (four slots of 512).

The issue's case (three ~1,000-token prompts, ``max_tokens`` 300, on ``-c 2048``) at half
scale, so that it runs in seconds on two shared cores: three ~450-token prompts with
``max_tokens`` 200 on 1,024 cells. Sent at once straight to ``u`` they overfill its pool and
all three fail; through kvroute each is reserved at prompt + max tokens, so they run one
after another and all succeed.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import all_reported, fleet_backends, gateway_cfg, run_gateway, wait_until
from tests.support.llama_servers import MODEL_ALIAS, LlamaServer, llama_servers, model_path

UNIFIED = ("-c", "1024", "-np", "4", "--kv-unified")
TWO_SLOTS = ("-c", "2048", "-np", "2")
FOUR_SLOTS = ("-c", "2048", "-np", "4")
# Words that the model's tokenizer and the gateway's default (cl100k) count alike: one
# token each with their leading space.
WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have which "
    "not but they we you he she his her their one all would there what so up out if about who "
    "get go me when make can like time no just him know take people into year your good some"
).split()


def prose(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, LlamaServer]]:
    with llama_servers(UNIFIED, TWO_SLOTS, FOUR_SLOTS) as (u, p1, p2):
        yield {"u": u, "p1": p1, "p2": p2}


def backend(name: str, server: LlamaServer, layout: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": server.url, "kind": "llamacpp", "kv_layout": layout, **extra}


def config(*backends: dict[str, Any], report_grace_s: float = 3.0) -> Any:
    return gateway_cfg(
        list(backends),
        # One llama-server step (up to -b 512 tokens) runs before /slots is answered.
        collector={"scrape_interval_s": 0.2, "timeout_s": 10.0, "stale_after_s": 30.0},
        # /slots shows a request only after a step of the server's loop (seconds on a
        # loaded CPU): until then its reservation counts as not in the report.
        store={"report_grace_s": report_grace_s},
        queue={"max_wait_s": 120.0},
        routing={"unknown_model": "reject"},
        # Counted with the model's own vocabulary, read from its GGUF file; SmolLM2's chat
        # template wraps each message in <|im_start|>ROLE\n ... <|im_end|>\n (4 tokens and
        # the role, which the gateway counts) and primes the reply with
        # <|im_start|>assistant\n (4 tokens).
        sizing={"tokenizer_file": str(model_path())},
        models={MODEL_ALIAS: {"tokens_per_message": 4, "reply_priming": 4}},
    )


def complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": MODEL_ALIAS, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=180)


def at_once(url: str, prompts: list[str], max_tokens: int) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens), prompts))


def tasks_started(server: LlamaServer) -> int:
    """Requests the server put in a slot so far (its log's ``launch_slot_`` lines)."""
    return len(re.findall(r"launch_slot_.*processing task", server.log_tail(10**7)))


def gateway_metric(gw: str, name: str, **labels: str) -> float:
    text = httpx.get(gw + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_unified_pool_overfilled_directly_fails_every_request(
    fleet: dict[str, LlamaServer],
) -> None:
    prompts = [prose(450, seed) for seed in (1, 2, 3)]
    answers = at_once(fleet["u"].url, prompts, 200)
    assert [r.status_code for r in answers] == [500, 500, 500]
    for r in answers:
        assert r.json()["error"]["message"] == "Context size has been exceeded."


def test_unified_pool_through_kvroute_holds_and_all_succeed(
    fleet: dict[str, LlamaServer],
) -> None:
    with run_gateway(config(backend("u", fleet["u"], "unified"))) as gw:
        wait_until(lambda: all_reported(gw, 1), 30, "u scraped")
        prompts = [prose(450, seed) for seed in (11, 12, 13)]
        answers = at_once(gw, prompts, 200)
        assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
        for r in answers:
            assert r.headers["x-kvroute-backend"] == "u"
            # The gateway's count is the server's: demand = usage.prompt_tokens + max_tokens.
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            assert int(r.headers["x-kvroute-demand-tokens"]) == prompt_tokens + 200


def running_on(gw: str, name: str) -> int:
    """Requests in ``name``'s slots, by the gateway's latest report of it."""
    report = next(b for b in fleet_backends(gw) if b["name"] == name)["report"] or {}
    return int(report.get("running", 0))


def test_context_exceeded_500_is_diverted_and_never_retried_on_that_node(
    fleet: dict[str, LlamaServer],
) -> None:
    """``u`` declared partitioned: kvroute reads four slots of 1,024 where one pool of 1,024
    lies. Once the first request shows in u's slots, a second goes to u too (an idle slot,
    by that reading); the two overfill the pool and the server fails both with its 500.
    Each is diverted to ``p1`` (long pool, two real slots of 1,024), which serves it; none
    goes back to ``u``."""
    u = backend("u", fleet["u"], "partitioned")
    p1 = backend("p1", fleet["p1"], "partitioned", pool="long")
    before = tasks_started(fleet["u"])
    # The default grace: once u's report shows the first request (and is newer than it by
    # more than the grace), its reservation no longer counts against u's idle slots.
    with run_gateway(config(u, p1, report_grace_s=0.25)) as gw:
        wait_until(lambda: all_reported(gw, 2), 30, "both scraped")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # ignore_eos: the first runs its 200 tokens, so it is still in u when the second
            # arrives.
            first = pool.submit(complete, gw, prose(450, 21), 200, ignore_eos=True)
            wait_until(lambda: running_on(gw, "u") >= 1, 30, "the first running on u")
            time.sleep(1.0)
            second = pool.submit(complete, gw, prose(450, 22), 200, ignore_eos=True)
            answers = [first.result(), second.result()]
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        # Each was tried on u once, then on p1, which answered.
        assert [r.headers["x-kvroute-backend"] for r in answers] == ["p1", "p1"]
        assert [r.headers["x-kvroute-attempts"] for r in answers] == ["2", "2"]
        failed_on_u = gateway_metric(gw, "kvroute_allocation_failures_total", backend="u")
        advice = httpx.get(gw + "/fleet/advice", timeout=10).json()
    assert failed_on_u == 2
    # Declared partitioned, u had room in total for what failed there: a layout advice
    # (llama.cpp's own flags), never a restart, which would start the same slots again.
    assert "u" in advice["slot_layout"]["servers"], advice["slot_layout"]
    assert "--kv-unified" in advice["slot_layout"]["reason"]
    assert "u" not in advice["restart"], advice
    assert tasks_started(fleet["u"]) - before == 2


def test_a_long_prompt_goes_to_the_slot_that_holds_it(fleet: dict[str, LlamaServer]) -> None:
    cfg = config(
        backend("p1", fleet["p1"], "partitioned"), backend("p2", fleet["p2"], "partitioned")
    )
    with run_gateway(cfg) as gw:
        wait_until(lambda: all_reported(gw, 2), 30, "both scraped")
        # 700 + 50 tokens: more than p2's slots of 512, within p1's of 1,024.
        for seed in (31, 32):
            r = complete(gw, prose(700, seed), 50)
            assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "p1"
            assert r.json()["usage"]["prompt_tokens"] == 700
        # Short ones may go anywhere, and do not fail.
        r = complete(gw, prose(60, 33), 20)
        assert r.status_code == 200


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled series ``name`` in a Prometheus page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_partitioned_server_defers_what_its_busy_slots_cannot_start_not_the_gateway(
    fleet: dict[str, LlamaServer],
) -> None:
    """p1's two slots of 1,024 take two requests; a third, sent with them, goes to p1 too
    and waits in the server's own queue (``llamacpp:requests_deferred``), not held at the
    gateway: a request one slot holds never fails there for room."""
    with run_gateway(config(backend("p1", fleet["p1"], "partitioned"))) as gw:
        wait_until(lambda: all_reported(gw, 1), 30, "p1 scraped")
        deferred = 0.0
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            # ignore_eos: each runs its 60 tokens, so the first two hold both slots a while.
            futures = [
                pool.submit(complete, gw, prose(300, seed), 60, ignore_eos=True)
                for seed in (51, 52, 53)
            ]
            while not all(f.done() for f in futures):
                page = httpx.get(fleet["p1"].url + "/metrics", timeout=30).text
                deferred = max(deferred, metric_value(page, "llamacpp:requests_deferred"))
                time.sleep(0.05)
            answers = [f.result() for f in futures]
        assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
        # None held at the gateway: no hold in any answer, no wait in the admission queue.
        assert [r.headers.get("server-timing") for r in answers] == [None, None, None]
        waits = httpx.get(gw + "/metrics", timeout=5).text
        assert metric_value(waits, "kvroute_queue_wait_seconds_count") == 0
    assert deferred >= 1


def test_a_request_held_its_limit_joins_a_partitioned_servers_line_not_a_503(
    fleet: dict[str, LlamaServer],
) -> None:
    """Six requests at once on p1's two slots: two run, one waits in p1's queue as the next
    in line, the rest are held at the gateway. A hold that runs ``queue.max_wait_s`` (0.3 s
    here, far less than a slot's turn) joins p1's line, as a hold for a queueing backend
    joins its queue: every request is served, none answered 503 for room p1 would make."""
    cfg = config(backend("p1", fleet["p1"], "partitioned"))
    cfg = cfg.model_copy(update={"queue": cfg.queue.model_copy(update={"max_wait_s": 0.3})})
    with run_gateway(cfg) as gw:
        wait_until(lambda: all_reported(gw, 1), 30, "p1 scraped")
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            # ignore_eos: each writes its 80 tokens, so both slots stay busy for seconds.
            futures = [
                pool.submit(complete, gw, prose(200, seed), 80, ignore_eos=True)
                for seed in range(61, 67)
            ]
            answers = [f.result() for f in futures]
        assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
        joined = gateway_metric(gw, "kvroute_queued_at_backend_total", why="hold_limit")
        assert joined >= 1, "no request was held to its limit: the test did not test the path"


def test_a_prompt_no_slot_holds_gets_the_gateways_400(fleet: dict[str, LlamaServer]) -> None:
    cfg = config(
        backend("p1", fleet["p1"], "partitioned"), backend("p2", fleet["p2"], "partitioned")
    )
    with run_gateway(cfg) as gw:
        models = lambda: httpx.get(gw + "/v1/models", timeout=5).json()["data"]  # noqa: E731
        # Both servers' models discovered (each server's in its own scrape).
        both = lambda: any(set(m.get("backends", ())) >= {"p1", "p2"} for m in models())  # noqa: E731
        wait_until(both, 30, "both servers' models discovered")
        listed = {m["id"]: m for m in models()}
        # The largest slot in the fleet, not a server's whole cache (2,048 on each).
        assert listed[MODEL_ALIAS]["max_model_len"] == 1024
        before = [tasks_started(fleet[n]) for n in ("p1", "p2")]
        r = complete(gw, prose(1200, 41), 50)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert "maximum context length is 1024 tokens" in err["message"]
        # Refused at the gateway: neither server saw it.
        assert [tasks_started(fleet[n]) for n in ("p1", "p2")] == before


def test_streamed_chat_through_the_gateway_with_the_openai_client(
    fleet: dict[str, LlamaServer],
) -> None:
    cfg = config(backend("p1", fleet["p1"], "partitioned"), backend("u", fleet["u"], "unified"))
    with run_gateway(cfg) as gw:
        wait_until(lambda: all_reported(gw, 2), 30, "both scraped")
        client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL_ALIAS,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text.strip()
        assert usage is not None and 0 < usage.completion_tokens <= 30
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_ALIAS,
            messages=[
                {"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Say hello to the reader of this test."},
            ],
            max_tokens=20,
        )
        answer = raw.parse()
        assert answer.choices[0].message.content
        # With a system message of its own (the template adds one otherwise), the gateway's
        # count of the chat is the server's.
        assert answer.usage is not None
        assert int(raw.headers["x-kvroute-demand-tokens"]) == answer.usage.prompt_tokens + 20
