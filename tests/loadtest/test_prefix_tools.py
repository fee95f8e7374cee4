"""The shared-document workload, the offline prefix simulator and the prefix benchmark keep working."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from loadtest.bench import prefix as bench
from loadtest.sim.prefix import SimCfg, simulate
from loadtest.workload import Turn, conversation_messages, shared_documents
from proxy.routing.affinity import AffinitySettings


def test_shared_documents_mix_popularity_and_follow_ups() -> None:
    w = shared_documents(2_000, 10.0, seed=3)
    kinds = Counter(t.kind for t in w.turns)
    assert 0.25 < kinds["document"] / 2_000 < 0.35
    docs = Counter(t.doc for t in w.turns if t.doc is not None)
    assert docs[0] > 3 * docs[39]  # Zipf: the first document is far more popular
    assert all(15_000 <= n <= 30_000 for n in w.doc_tokens) and len(w.doc_tokens) == 40
    # A follow-up resends its conversation: the earlier turn's messages are its prefix.
    history: dict[int, list[Turn]] = {}
    checked = 0
    for t in w.turns:
        past = history.setdefault(t.conversation, [])
        if t.turn == 1 and t.doc is not None:
            before = conversation_messages(w, past[0], [])
            after = conversation_messages(w, t, past)
            assert after[: len(before)] == before and len(after) == len(before) + 2
            checked += 1
        past.append(t)
        if checked >= 3:
            break
    assert checked == 3


def test_offline_affinity_raises_the_hit_rate() -> None:
    w = shared_documents(400, 4.0, seed=1)
    cfg = SimCfg()
    off = simulate(w, "kvroute", AffinitySettings(enabled=False), cfg)
    on = simulate(w, "kvroute", AffinitySettings(), cfg)
    assert on.hit_rate > off.hit_rate + 0.05
    assert on.doc_ttft_p50_s < off.doc_ttft_p50_s


def test_bench_runs_end_to_end_tiny(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "prefix.json"
    argv = ["--only", "contiguous", "--requests", "6", "--rate", "20", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows] == ["kvroute, no affinity", "kvroute + affinity"]
    assert all(r["requests"] == 6 and r["failed"] == 0 for r in rows)
