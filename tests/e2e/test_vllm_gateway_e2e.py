"""Through the real gateway, against vLLM-mode engines: model routing, the 400, pressure,
and queueing backends that are never answered 503 because memory looks short."""

from __future__ import annotations

import concurrent.futures
import http.server
import threading
from typing import Any

import httpx

from tests.support.behaviours import engine_state, engines
from tests.support.gateway import all_reported, gateway_cfg, run_gateway, wait_until

FAST = {"speedup": 20, "block_size": 16}


def backends(urls: dict[str, str], **extra: Any) -> list[dict[str, Any]]:
    return [{"name": n, "url": u, "kind": "vllm", **extra} for n, u in urls.items()]


def listed(gw: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(gw + "/v1/models", timeout=5).json()["data"]}


def test_model_routing_404_and_the_fleets_model_list() -> None:
    specs = [
        ("vllm", "a", {"model": "alpha", "data_parallel": 2, "max_model_len": 4000, **FAST}),
        ("vllm", "b", {"model": "beta", "max_model_len": 1000, **FAST}),
    ]
    with engines(*specs) as urls:
        cfg = gateway_cfg(backends(urls), routing={"unknown_model": "reject"})
        with run_gateway(cfg) as gw:
            # From the gateway's catalog (with "backends"), not the live answer it relays while
            # no backend's models are known yet (that one passed the wait and then failed here).
            wait_until(
                lambda: (
                    {m: "backends" in v for m, v in listed(gw).items()}
                    == {"alpha": True, "beta": True}
                ),
                what="models discovered",
            )
            models = listed(gw)
            assert models["alpha"]["max_model_len"] == 4000 and models["alpha"]["backends"] == ["a"]
            assert models["beta"]["max_model_len"] == 1000 and models["beta"]["backends"] == ["b"]
            for model, backend in [("alpha", "a"), ("beta", "b")] * 3:
                body = {"model": model, "prompt": "hello there", "max_tokens": 5}
                r = httpx.post(gw + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200 and r.headers["x-kvroute-backend"] == backend
            r = httpx.post(
                gw + "/v1/chat/completions",
                json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}]},
            )
            err = r.json()["error"]
            assert r.status_code == 404 and err["code"] == "model_not_found"
            assert "alpha, beta" in err["message"] and err["param"] == "model"


def test_max_model_len_400_in_vllms_words_before_any_backend_sees_it() -> None:
    with engines(("vllm", "b", {"model": "beta", "max_model_len": 1000, **FAST})) as urls:
        cfg = gateway_cfg(backends(urls, models=["beta"]), routing={"unknown_model": "reject"})
        with run_gateway(cfg) as gw:
            wait_until(lambda: listed(gw).get("beta", {}).get("max_model_len") == 1000)
            body = {"model": "beta", "prompt": "word " * 100, "max_tokens": 950}
            r = httpx.post(gw + "/v1/completions", json=body, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert "maximum context length is 1000 tokens" in err["message"]
            assert err["param"] == "max_tokens"
            long_prompt = {"model": "beta", "prompt": "word " * 1200}
            r = httpx.post(gw + "/v1/completions", json=long_prompt, timeout=30)
            assert r.status_code == 400 and "input tokens" in r.json()["error"]["message"]
            # Neither reached the engine: its own counters saw nothing.
            metrics = httpx.get(urls["b"] + "/metrics").text
            assert 'vllm:request_success_total{engine="0",finished_reason="length"' not in metrics
            ok = {"model": "beta", "prompt": "word " * 100, "max_tokens": 50}
            assert httpx.post(gw + "/v1/completions", json=ok, timeout=30).status_code == 200


def test_a_saturated_node_ranks_as_full_and_shows_why() -> None:
    # One slot each; decode slow enough that a request holds its slot for ~8 s, so "busy"
    # stays saturated (one running, one waiting) for ~16 s: far longer than the few scrapes
    # and requests below take on a loaded machine. (At ~2 s per request it drained first
    # under load, the pressure lifted, and the tie went to "busy" by name.)
    slow = {"max_num_seqs": 1, "decode_tokens_per_s": 10, "speedup": 1, "model": "m"}
    with engines(("vllm", "busy", slow), ("vllm", "idle", slow)) as urls:
        cfg = gateway_cfg(backends(urls))
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            # Fill "busy" behind the gateway's back: one running, one waiting.
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                body = {"model": "m", "prompt": "x", "max_tokens": 80}
                futs = [
                    pool.submit(httpx.post, urls["busy"] + "/v1/completions", json=body, timeout=30)
                    for _ in range(2)
                ]
                wait_until(lambda: engine_state(urls["busy"])[0]["waiting"] == 1, what="queue")

                def pressure() -> dict[str, Any]:
                    return {
                        b["name"]: b["overlay"]["pressure"]
                        for b in httpx.get(gw + "/fleet").json()["backends"]
                    }

                wait_until(lambda: pressure()["busy"] is not None, what="pressure seen")
                assert pressure()["busy"] in ("slots", "queue") and pressure()["idle"] is None
                metrics = httpx.get(gw + "/metrics").text
                assert 'kvroute_backend_pressure{backend="busy",reason="' in metrics
                # A new request goes to the idle node, though "busy" has more KV free than it needs.
                short = {"model": "m", "prompt": "y", "max_tokens": 2}
                for _ in range(3):
                    r = httpx.post(gw + "/v1/completions", json=short, timeout=30)
                    assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "idle"
                assert all(f.result().status_code == 200 for f in futs)


def test_queueing_backends_are_never_a_503_and_a_burst_spreads() -> None:
    # Each engine holds two requests at full demand; twelve arrive at once, and the
    # gateway's hold is short (also for memory pressure): what does not fit joins an
    # engine's queue, nothing fails.
    flags = {"capacity_tokens": 2048, "block_size": 16, "speedup": 10, "model": "m"}
    with engines(("vllm", "v0", flags), ("vllm", "v1", flags)) as urls:
        # Staleness is not under test: on a loaded machine an engine busy generating can miss
        # scrapes for 2 s, and a stale node is (rightly) excluded, which piled the burst onto
        # the other one (seen: 10 vs 2). A long staleness bound keeps both nodes eligible.
        # The hold is short for memory pressure too (memory_pressure.max_hold_s).
        cfg = gateway_cfg(
            backends(urls),
            queue={"max_wait_s": 0.3},
            collector={"stale_after_s": 60.0},
            memory_pressure={"max_hold_s": 0.3},
        )
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            body = {"model": "m", "prompt": "one two three four " * 25, "max_tokens": 880}
            # A real burst: every client is built before a barrier, so the twelve requests
            # arrive together rather than one per thread start (slow on a loaded machine).
            start = threading.Barrier(12)

            def call(_: int) -> httpx.Response:
                with httpx.Client(timeout=120) as client:
                    start.wait(timeout=60)
                    return client.post(gw + "/v1/completions", json=body)

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                answers = list(pool.map(call, range(12)))
            assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
            placed = [r.headers["x-kvroute-backend"] for r in answers]
            # By design both nodes take work while both are eligible: a node with fewer
            # requests in flight (the gateway's own count, updated at once) ranks first, so a
            # burst arriving together splits about evenly; 3 of 12 leaves a wide margin.
            assert placed.count("v0") >= 3 and placed.count("v1") >= 3, placed
            metrics = httpx.get(gw + "/metrics").text
            assert "kvroute_queued_at_backend_total{" in metrics
            pools = httpx.get(gw + "/fleet/advice").json()["pools"]
            assert pools["pools"]["general"]["nodes"] == 2 and pools["verdict"] == "unknown"


class _OomTgi(http.server.BaseHTTPRequestHandler):
    """A TGI that runs out of memory on every generation (424, TGI's own error shape)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = b'{"error": "Request failed during generation: CUDA out of memory", "error_type": "generation"}'
        self.send_response(424)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # A healthy-looking TGI's /metrics (copied from a real TGI-mode engine by the test).
    metrics = b""

    def do_GET(self) -> None:
        body = self.metrics if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_tgi_out_of_memory_424_is_diverted_not_relayed() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OomTgi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with engines(("tgi", "good", {"model": "m", **FAST})) as urls:
            _OomTgi.metrics = httpx.get(urls["good"] + "/metrics").content
            bad = f"http://127.0.0.1:{server.server_address[1]}"
            cfg = gateway_cfg(
                [
                    {"name": "oom", "url": bad, "kind": "tgi", "models": ["m"]},
                    {"name": "good", "url": urls["good"], "kind": "tgi", "models": ["m"]},
                ],
                routing={"policy": "round_robin"},
                health={"active": {"enabled": False}},
            )
            with run_gateway(cfg) as gw:
                wait_until(lambda: all_reported(gw, 2), what="reports")
                body = {"model": "m", "prompt": "hello", "max_tokens": 3}
                answers = [
                    httpx.post(gw + "/v1/completions", json=body, timeout=30) for _ in range(4)
                ]
                assert [r.status_code for r in answers] == [200] * 4
                assert {r.headers["x-kvroute-backend"] for r in answers} == {"good"}
                assert 'result="allocation"' in httpx.get(gw + "/metrics").text
    finally:
        server.shutdown()


def test_the_prefill_rate_is_learned_from_the_engines_own_metrics() -> None:
    # The engine prefills 10k tokens/s (1,000 x speedup 10); the configured rate is 5x that.
    flags = {"prefill_tokens_per_s": 1_000, "speedup": 10, "model": "m", "block_size": 16}
    with engines(("vllm", "v0", flags)) as urls:
        cfg = gateway_cfg(backends(urls, prefill_tokens_per_s=50_000))
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 1), what="reports")

            def in_use() -> float | None:
                # The rate is learned where it is used: ranking by expected wait, pool advice.
                httpx.get(gw + "/fleet/advice", timeout=5)
                for line in httpx.get(gw + "/metrics").text.splitlines():
                    if line.startswith('kvroute_backend_prefill_tokens_per_second{backend="v0"}'):
                        return float(line.rsplit(" ", 1)[1])
                return None

            def body(i: int) -> dict[str, Any]:
                # A different prompt each time: prefix-cache hits are not prefilled (nor counted).
                return {"model": "m", "prompt": f"{i} alpha beta gamma " * 250, "max_tokens": 2}

            for i in range(2):
                r = httpx.post(gw + "/v1/completions", json=body(i), timeout=30)
                assert r.status_code == 200
            wait_until(lambda: in_use() is not None, what="a rate in use")
            # Before enough work finished (or before the report showed it): the configured one.
            first = in_use()
            assert first is not None
            for i in range(2, 6):
                r = httpx.post(gw + "/v1/completions", json=body(i), timeout=30)
                assert r.status_code == 200
            wait_until(lambda: (in_use() or 0) < 20_000, what="the learned rate")
            learned = in_use()
            assert learned is not None and 5_000 <= learned <= 12_000, learned
