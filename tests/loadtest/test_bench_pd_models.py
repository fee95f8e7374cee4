"""``python -m loadtest.bench pd --engine-model``: every engine model plays its P/D role.

One real request through the benchmark's own engine processes (a prefill and a decode server
of each model, started as ``pd.start_engine`` starts them), the way vLLM's NIXL proxy sends
it: step 1 to the prefill server (computed there, its blocks held), step 2 to the decode
server with the params that step 1 answered (it pulls the blocks and streams the answer).
Then kvroute's config for each model: tuned with ``default``, as a user first deploys it
with ``classic`` and ``v1``.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import pytest

from loadtest.bench import pd
from loadtest.bench.do_no_harm_cells import model_extra_flags
from loadtest.bench.engine_fleet import MODEL
from loadtest.children import stop_processes
from loadtest.engine.behaviours.scheduler import PagedCore, SimRequest
from tests.support.behaviours import server_state

# 9,001 prompt tokens: more than one v1 step's token budget (8,192), so a v1 server that
# computed the prompt itself would take one step more than it writes tokens.
PROMPT = "word " * 9_000
OUTPUT = 8


def stream_step_two(url: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Step 2, streamed: every SSE event's JSON."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": OUTPUT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": params,
    }
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model", pd.ENGINE_MODELS)
def test_one_request_is_prefilled_on_one_server_and_decoded_on_the_other(model: str) -> None:
    args = pd.build_parser().parse_args(["--engine-model", model, "--speedup", "20"])
    procs: list[subprocess.Popen[str]] = []
    urls: dict[str, str] = {}
    try:
        for name, role in (("p0", "prefill"), ("d0", "decode")):
            proc, urls[name] = pd.start_engine(name, role, args)
            procs.append(proc)
        step1 = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        step1["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        answer = httpx.post(urls["p0"] + "/v1/completions", json=step1, timeout=30)
        assert answer.status_code == 200
        params = answer.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and server_state(urls["p0"])["kv_holds"] == 1
        events = stream_step_two(urls["d0"], params)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert text and events[-1]["usage"]["completion_tokens"] == OUTPUT
        prefill, decode = server_state(urls["p0"]), server_state(urls["d0"])
    finally:
        stop_processes(procs)
    # Pulled once; nothing held or running on either side afterwards.
    assert (prefill["kv_holds"], prefill["kv_pulled"]) == (0, 1)
    (p_engine,), (d_engine,) = prefill["engines"], decode["engines"]
    for engine in (p_engine, d_engine):
        assert engine["finished"] == 1 and engine["used_tokens"] == 0
        assert engine["preemptions"] == 0
    if model == "v1":
        # The prefill server computed the prompt in two budgets; the decode server none of it:
        # one step recomputes the last prompt token and samples, then one step per token.
        assert p_engine["steps"] == 2 and d_engine["steps"] == OUTPUT


def test_a_pulled_prompt_skips_the_serial_prefill_queue() -> None:
    # The classic model with --serial-prefill: one prompt prefilled after another, but a
    # decode server's pulled prompt only waits for its transfer, not for that queue.
    c = PagedCore(1_000, 16, 64, 0.01, 1_000.0, serial_prefill=True)
    local = SimRequest(1_000, 4, 0.0)
    remote = SimRequest(1_000, 4, 0.0)
    remote.transfer_tokens_per_s = 100_000.0
    c.submit(local, 0.0)
    c.submit(remote, 0.0)
    assert local.decode_at == pytest.approx(1.0) and remote.decode_at == pytest.approx(0.01)
    assert c.prefill_free_at == pytest.approx(1.0)


def config(*argv: str) -> dict[str, Any]:
    """kvroute's config for the benchmark's flags ``argv`` (the engines' URLs made up)."""
    urls = {n: f"http://127.0.0.1:1/{n}" for n in (*pd.PREFILL, *pd.DECODE)}
    return pd.gateway_config(urls, pd.build_parser().parse_args(argv))


@pytest.mark.parametrize("model", ["classic", "v1"])
def test_the_engine_models_run_kvroute_as_first_deployed(model: str) -> None:
    cfg = config("--engine-model", model)
    assert set(cfg) == {"listen", "backends"}
    assert all(set(b) == {"name", "url", "kind", "role"} for b in cfg["backends"])
    assert [b["role"] for b in cfg["backends"]] == ["prefill", "prefill", "decode", "decode"]
    # Every engine, prefill and decode alike, gets the model's own flags.
    assert pd.engine_model_flags(model) == model_extra_flags(model)


def test_the_default_model_keeps_the_rates_and_levers() -> None:
    cfg = config()
    assert cfg["disaggregation"] == {"min_uncached_prompt_tokens": 512}
    assert cfg["queue"] == {"max_wait_s": 30.0}
    assert all(b["prefill_tokens_per_s"] == 16_000.0 for b in cfg["backends"])
    assert pd.engine_model_flags("default") == ["--serial-prefill"]


def test_v1_needs_the_vllm_protocol() -> None:
    with pytest.raises(SystemExit):
        pd.main(["--engine-model", "v1", "--protocol", "sglang"])
