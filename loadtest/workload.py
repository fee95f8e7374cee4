"""Workload generators and trace replay: lists of timed requests, and prompt text to send.

Pure and seeded (a ``random.Random`` per call), so a benchmark, the offline simulator and a
test that use the same seed see the same requests. The default mix is the problem's: 70%
short chat queries (under 500 tokens) and 30% long documents (15,000-30,000 tokens),
arriving as a Poisson process.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

Kind = Literal["short", "long"]
Range = tuple[int, int]

#: Prompts at or above this many tokens are labelled "long" when a trace is read
#: (the gateway's default routing.long_threshold_tokens).
DEFAULT_LONG_THRESHOLD = 8_000


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload: when it arrives (seconds from the start) and its sizes."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: Kind = "short"

    @property
    def total_tokens(self) -> int:
        """KV demand when max_tokens is the output length: prompt + output."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class MixClass:
    """One class of a mix: its share of requests and uniform ranges (inclusive) for its sizes."""

    kind: Kind
    share: float
    prompt: Range
    output: Range


# Output lengths are not given by the problem statement; chat answers are short-ish,
# document analyses write a summary.
SHORT_OUTPUT: Range = (16, 256)
LONG_OUTPUT: Range = (128, 1024)


def _check_range(name: str, r: Range) -> None:
    lo, hi = r
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}: need 1 <= low <= high, got {r}")


def iter_parametric(
    rate_per_s: float,
    classes: Sequence[MixClass],
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> Iterator[Request]:
    """Poisson arrivals at ``rate_per_s``; each request's class drawn by share.

    Stops after ``n`` requests or at ``duration_s`` (whichever is given; both: the first).
    """
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
    if n is None and duration_s is None:
        raise ValueError("give n or duration_s (or both)")
    if not classes:
        raise ValueError("need at least one MixClass")
    for c in classes:
        if c.share < 0:
            raise ValueError(f"share must be >= 0, got {c.share}")
        _check_range(f"{c.kind}.prompt", c.prompt)
        _check_range(f"{c.kind}.output", c.output)
    total = sum(c.share for c in classes)
    if total <= 0:
        raise ValueError("shares must add up to more than 0")
    cum: list[float] = []
    acc = 0.0
    for c in classes:
        acc += c.share / total
        cum.append(acc)
    rng = random.Random(seed)
    t = 0.0
    count = 0
    while n is None or count < n:
        t += rng.expovariate(rate_per_s)
        if duration_s is not None and t > duration_s:
            return
        u = rng.random()
        c = classes[-1]
        for k, edge in enumerate(cum):
            if u < edge:
                c = classes[k]
                break
        yield Request(t, rng.randint(*c.prompt), rng.randint(*c.output), c.kind)
        count += 1


def parametric(
    rate_per_s: float,
    classes: Sequence[MixClass],
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[Request]:
    """A list from :func:`iter_parametric`."""
    return list(iter_parametric(rate_per_s, classes, n=n, duration_s=duration_s, seed=seed))


def bimodal_classes(
    short_share: float = 0.7,
    short: Range = (20, 500),
    long: Range = (15_000, 30_000),
    short_output: Range = SHORT_OUTPUT,
    long_output: Range = LONG_OUTPUT,
) -> list[MixClass]:
    if not 0.0 <= short_share <= 1.0:
        raise ValueError(f"short_share must be within [0, 1], got {short_share}")
    return [
        MixClass("short", short_share, short, short_output),
        MixClass("long", 1.0 - short_share, long, long_output),
    ]


def bimodal(
    rate_per_s: float,
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    short_share: float = 0.7,
    short: Range = (20, 500),
    long: Range = (15_000, 30_000),
    short_output: Range = SHORT_OUTPUT,
    long_output: Range = LONG_OUTPUT,
) -> list[Request]:
    """The problem statement's mix: 70% short (20-500 prompt tokens), 30% long (15k-30k)."""
    classes = bimodal_classes(short_share, short, long, short_output, long_output)
    return parametric(rate_per_s, classes, n=n, duration_s=duration_s, seed=seed)


# --- traces ----------------------------------------------------------------------------


def _parse_ts(s: str) -> float:
    """``YYYY-MM-DD HH:MM:SS.fffffff`` (Azure trace: 7 fractional digits) -> unix-like seconds."""
    s = s.strip()
    head, _, frac = s.partition(".")
    base = datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def _kind(prompt_tokens: int, threshold: int) -> Kind:
    return "long" if prompt_tokens >= threshold else "short"


def load_trace(
    path: str | Path,
    length_scale: float = 1.0,
    rate_scale: float = 1.0,
    *,
    output_scale: float = 1.0,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
    limit: int | None = None,
) -> list[Request]:
    """Read a trace: Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or JSONL.

    JSONL lines are ``{"arrival_s": .., "prompt_tokens": .., "output_tokens": ..}`` (``kind``
    optional). Arrivals are made relative to the first request, then divided by
    ``rate_scale`` (2.0 replays twice as fast); prompt lengths are multiplied by
    ``length_scale`` and output lengths by ``output_scale`` (each at least 1 token).
    """
    if length_scale <= 0 or rate_scale <= 0 or output_scale <= 0:
        raise ValueError("length_scale, rate_scale and output_scale must be positive")
    p = Path(path)
    rows = list(_read_jsonl(p) if p.suffix in (".jsonl", ".ndjson") else _read_csv(p))
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        return []
    t0 = rows[0][0]
    out: list[Request] = []
    for arrival, prompt, output, kind in rows:
        pt = max(1, round(prompt * length_scale))
        ot = max(1, round(output * output_scale))
        k: Kind = kind if kind is not None else _kind(pt, long_threshold)
        out.append(Request(max(0.0, (arrival - t0) / rate_scale), pt, ot, k))
    out.sort(key=lambda r: r.arrival_s)
    return out


_Row = tuple[float, int, int, Kind | None]


def _read_csv(p: Path) -> Iterator[_Row]:
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise ValueError(f"{p}: expected CSV columns {sorted(need)}, got {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            try:
                yield (
                    _parse_ts(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                    None,
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{p}:{line}: bad row {row!r}: {exc}") from None


def _read_jsonl(p: Path) -> Iterator[_Row]:
    with p.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                kind = d.get("kind")
                if kind not in (None, "short", "long"):
                    raise ValueError(f"kind must be 'short' or 'long', got {kind!r}")
                yield float(d["arrival_s"]), int(d["prompt_tokens"]), int(d["output_tokens"]), kind
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{p}:{line_no}: bad line: {exc}") from None


def write_jsonl(requests: Iterable[Request], path: str | Path) -> None:
    """Save a workload in the JSONL form :func:`load_trace` reads."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


# --- prompt text -----------------------------------------------------------------------

# Common English words that are each exactly one cl100k token with a leading space; the
# tokenizer's pre-split never merges across " word" boundaries, so N words are N tokens.
WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is you that it he was for on are as with his they at be this have "
        "from or one had by word but not what all were we when your can said there use an each "
        "which she do how their if will up other about out many then them these so some her "
        "would make like him into time has look two more write go see number no way could "
        "people my than first water been call who its now find long down day did get come "
        "made may part"
    ).split()
)


def make_prompt(tokens: int, rng: random.Random | None = None) -> str:
    """Text of exactly ``tokens`` cl100k tokens (0 -> ""), built from random common words.

    Fast enough for 30k-token prompts in a load generator (a join, no tokenizer calls).
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if tokens == 0:
        return ""
    r = rng if rng is not None else random.Random(0)
    words = r.choices(WORDS, k=tokens)
    return " ".join(words)


def chat_overhead_tokens(
    tokens_per_message: int = 3, reply_priming: int = 3, role: str = "user"
) -> int:
    """Tokens a one-message chat adds around its content (role, per-message, priming)."""
    del role  # "user", "system" and "assistant" are each one token
    return tokens_per_message + 1 + reply_priming


def summary(requests: Sequence[Request]) -> dict[str, float]:
    """Counts and means for reports: how many, share long, mean sizes, offered rate."""
    if not requests:
        return {
            "n": 0,
            "long_share": 0.0,
            "mean_prompt": 0.0,
            "mean_output": 0.0,
            "rate_per_s": 0.0,
        }
    n = len(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    return {
        "n": n,
        "long_share": sum(1 for r in requests if r.kind == "long") / n,
        "mean_prompt": sum(r.prompt_tokens for r in requests) / n,
        "mean_output": sum(r.output_tokens for r in requests) / n,
        "rate_per_s": (n - 1) / span if span > 0 and not math.isclose(span, 0.0) else 0.0,
    }


# --- multi-turn conversations over shared long documents -------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation: a question about a document (``doc``) or a short chat.

    Turn ``turn`` of conversation ``conversation`` resends the turns before it (chat history),
    so a follow-up shares its whole prefix with the request before it, and every question
    about one document shares the document.
    """

    arrival_s: float
    conversation: int
    doc: int | None
    turn: int
    question_tokens: int
    output_tokens: int

    @property
    def kind(self) -> str:
        return "document" if self.doc is not None else "chat"


@dataclass(frozen=True, slots=True)
class SharedDocs:
    turns: tuple[Turn, ...]
    doc_tokens: tuple[int, ...]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ``n`` items by rank: 1 / rank^s."""
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def shared_documents(
    n: int,
    rate_per_s: float,
    *,
    doc_share: float = 0.3,
    docs: int = 40,
    doc_tokens: Range = (15_000, 30_000),
    zipf_s: float = 1.1,
    follow_up: float = 0.5,
    question: Range = (20, 80),
    chat: Range = (50, 500),
    output: Range = (32, 256),
    seed: int = 0,
) -> SharedDocs:
    """``doc_share`` of requests ask about one of ``docs`` documents (Zipf popularity), the rest
    are short chats; with probability ``follow_up`` a request continues a recent conversation
    (same document, history resent) instead of starting one. Poisson arrivals at ``rate_per_s``.
    """
    for name, r in (("doc_tokens", doc_tokens), ("question", question), ("chat", chat)):
        _check_range(name, r)
    rng = random.Random(seed)
    sizes = tuple(rng.randint(*doc_tokens) for _ in range(docs))
    weights = zipf_weights(docs, zipf_s)
    open_by_doc: dict[int | None, list[tuple[int, int]]] = {}
    turns: list[Turn] = []
    t = 0.0
    next_conv = 0
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        doc = rng.choices(range(docs), weights)[0] if rng.random() < doc_share else None
        recent = open_by_doc.setdefault(doc, [])
        if recent and rng.random() < follow_up:
            i = rng.randrange(max(0, len(recent) - 8), len(recent))
            conv, turn = recent[i]
            recent[i] = (conv, turn + 1)
            turn += 1
        else:
            conv, turn = next_conv, 0
            next_conv += 1
            recent.append((conv, 0))
        size = rng.randint(*(question if doc is not None else chat))
        turns.append(Turn(t, conv, doc, turn, size, rng.randint(*output)))
    return SharedDocs(tuple(turns), sizes)


def document_text(doc: int, tokens: int) -> str:
    """Document ``doc``'s text: the same ``tokens`` tokens every time it is asked about."""
    return make_prompt(tokens, random.Random(10_007 * (doc + 1)))


def conversation_messages(
    w: SharedDocs, turn: Turn, history: Sequence[Turn]
) -> list[dict[str, str]]:
    """The chat body's messages of ``turn``: the document, earlier questions and answers, the question."""
    msgs: list[dict[str, str]] = []
    if turn.doc is not None:
        doc = document_text(turn.doc, w.doc_tokens[turn.doc])
        msgs.append({"role": "system", "content": "Answer from this document.\n\n" + doc})
    for past in [*history, turn]:
        rng = random.Random(past.conversation * 1_000 + past.turn)
        msgs.append({"role": "user", "content": make_prompt(past.question_tokens, rng)})
        if past is not turn:
            msgs.append({"role": "assistant", "content": make_prompt(past.output_tokens, rng)})
    return msgs
