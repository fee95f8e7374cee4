"""Request body -> prompt tokens: what every counted field of a request costs.

The rules (the README's "Sizing rules" table is the user-facing copy):

- Chat: ``reply_priming`` + per message ``tokens_per_message`` + role + content + name
  (+ ``tokens_per_name``) + each tool call's name and arguments (+ ``tokens_per_tool_call``)
  + ``tool_call_id``. Content is a string or a list of parts; each text part (or bare
  string part) is counted on its own; image, audio, video and file parts count a fixed,
  configurable estimate each (their size depends on the model's processor, which the gateway
  does not run). Parts of an unknown type count the tokens of their JSON.
- ``tools`` (and legacy ``functions``): the tokens of each definition's compact JSON plus
  ``tokens_per_tool``; chat templates render the schema as JSON into the prompt.
- Completions: one count per prompt (a string, a list of strings, token ids, or a list of
  token-id lists); ``prompt_embeds`` count decoded bytes / ``prompt_embeds_bytes_per_token``.

A single field longer than ``max_field_chars`` is not tokenized: it counts its UTF-8 byte
length, an upper bound for byte-level tokenizers (each token is at least one byte). That caps
the work one field can cause (tiktoken spends ~1.7 s on 3.9 MB of one repeated letter).
Texts of ``cache_min_chars`` or more go through the shared ``TokenCache``. Given an
``PiecesCache`` (prefix affinity is on), a text is counted as the size of its pieces taken
from that cache: the one encode that sizes the request also gives the prefix index its
hashes' pieces (``proxy.core.prefix_prompt``), instead of tokenizing every prompt twice.

Pure: no asyncio. ``proxy.gateway.sizing`` decides inline vs worker thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.prefix_prompt import PiecesCache, TextPieces, text_pieces
from proxy.core.tokenizer import Counter, TiktokenCounter, TokenCache

_MEDIA_KINDS = ("image", "audio", "video", "file")
#: A message with only these keys is cached as a whole (see ``PromptCounter.message``).
_PLAIN_KEYS = frozenset({"role", "content", "name"})


@dataclass(frozen=True, slots=True)
class SizingRules:
    """How a model's prompt is counted beyond its raw text (config: ``sizing``, ``models``)."""

    tokens_per_message: int = 3
    reply_priming: int = 3
    tokens_per_name: int = 1
    tokens_per_tool: int = 3
    tokens_per_tool_call: int = 3
    image_part_tokens: int = 1024
    audio_part_tokens: int = 750
    video_part_tokens: int = 4096
    file_part_tokens: int = 1024
    prompt_embeds_bytes_per_token: int = 2048
    max_field_chars: int = 1_048_576
    cache_min_chars: int = 256

    def media_tokens(self, kind: str) -> int:
        return {
            "image": self.image_part_tokens,
            "audio": self.audio_part_tokens,
            "video": self.video_part_tokens,
        }.get(kind, self.file_part_tokens)


def utf8_len(text: str) -> int:
    """UTF-8 byte length without copying ASCII text (``isascii`` is O(1) in CPython)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def media_kind(part_type: str) -> str | None:
    """``image_url``, ``input_audio``, ``video_url``, ``file``... -> its media kind, else None."""
    for kind in _MEDIA_KINDS:
        if kind in part_type:
            return kind
    return None


def json_text(value: Any) -> str:
    """Compact JSON as a template's ``tojson`` renders it (key order kept)."""
    return orjson.dumps(value).decode()


class PromptCounter:
    """Counts one request's prompt with one model's tokenizer and rules."""

    def __init__(
        self,
        counter: Counter,
        rules: SizingRules,
        cache: TokenCache | None,
        pieces: PiecesCache | None = None,
    ) -> None:
        self.counter = counter
        self.rules = rules
        self.cache = cache
        # Only plain texts (kind "t": contents, text parts) are what the prefix index hashes.
        encode: TextPieces | None = text_pieces(counter)
        self._pieces = pieces if encode is not None else None
        self._encode = encode

    def text(self, text: str, kind: str = "t") -> int:
        if not text:
            return 0
        if len(text) > self.rules.max_field_chars:
            return utf8_len(text)
        if self.cache is None or len(text) < self.rules.cache_min_chars:
            return self._count(text, kind)
        key = self.cache.key(self.counter.id, kind, text)
        n = self.cache.get(key)
        if n is None:
            n = self._count(text, kind)
            self.cache.put(key, n)
        return n

    def _count(self, text: str, kind: str) -> int:
        pieces, encode = self._pieces, self._encode
        if pieces is not None and encode is not None and kind == "t":
            # The pieces stay cached for the prefix hashes of the same request (one encode).
            return pieces.count(self.counter.id, encode, text)
        return self.counter.count(text)

    def content(self, content: Any) -> int:
        if isinstance(content, str):
            return self.text(content)
        if not isinstance(content, list):
            return 0
        return sum(self.part(p) for p in content)

    def part(self, part: Any) -> int:
        if isinstance(part, str):
            return self.text(part)
        if not isinstance(part, dict):
            return 0
        ptype = str(part.get("type", ""))
        for key in ("text", "refusal"):
            if isinstance(part.get(key), str):
                return self.text(part[key])
        kind = media_kind(ptype)
        if kind is not None:
            return self.rules.media_tokens(kind)
        return self.text(json_text(part), "part")

    def tool_calls(self, message: dict[str, Any]) -> int:
        calls: list[Any] = []
        if isinstance(message.get("tool_calls"), list):
            calls.extend(message["tool_calls"])
        if isinstance(message.get("function_call"), dict):
            calls.append({"function": message["function_call"]})
        total = 0
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                continue
            args = fn.get("arguments")
            args_text = args if isinstance(args, str) else "" if args is None else json_text(args)
            total += self.rules.tokens_per_tool_call + self.text(str(fn.get("name") or ""))
            # Kind "args": arguments are counted, never prefix-hashed (no ids kept for them).
            total += self.text(args_text, "args")
        return total

    def message(self, m: dict[str, Any]) -> int:
        content = m.get("content")
        if (
            self.cache is not None
            and isinstance(content, str)
            and len(content) >= self.rules.cache_min_chars
            and len(content) <= self.rules.max_field_chars
            and m.keys() <= _PLAIN_KEYS
        ):
            # The common message (role + text) is one cache entry: one hash, one lookup.
            name = m.get("name")
            key = self.cache.key(self.counter.id, "msg", str(m.get("role", "")), content)
            if isinstance(name, str):
                key = self.cache.key(self.counter.id, "named", key.hex(), name)
            n = self.cache.get(key)
            if n is None:
                n = self._message(m)
                self.cache.put(key, n)
            return n
        return self._message(m)

    def _message(self, m: dict[str, Any]) -> int:
        n = self.rules.tokens_per_message + self.text(str(m.get("role", "")))
        n += self.content(m.get("content"))
        if isinstance(m.get("name"), str):
            n += self.text(m["name"]) + self.rules.tokens_per_name
        if isinstance(m.get("tool_call_id"), str):
            n += self.text(m["tool_call_id"])
        return n + self.tool_calls(m)

    def tools(self, tools: Any) -> int:
        """Every definition's JSON + ``tokens_per_tool``; the whole list is cached as one."""
        if not isinstance(tools, list) or not tools:
            return 0
        texts = [json_text(t) for t in tools]
        key = None
        if self.cache is not None:
            key = self.cache.key(self.counter.id, "tools", "\n".join(texts))
            hit = self.cache.get(key)
            if hit is not None:
                return hit
        n = sum(self.text(t, "tool") + self.rules.tokens_per_tool for t in texts)
        if self.cache is not None and key is not None:
            self.cache.put(key, n)
        return n

    def chat(self, body: dict[str, Any]) -> int:
        msgs = body.get("messages")
        total = self.rules.reply_priming
        if isinstance(msgs, list):
            total += sum(self.message(m) for m in msgs if isinstance(m, dict))
        return total + self.tools(body.get("tools")) + self.tools(body.get("functions"))

    def prompts(self, body: dict[str, Any]) -> list[int]:
        """One count per sequence a completions request starts (each prompt is its own)."""
        out: list[int] = []
        p = body.get("prompt")
        if isinstance(p, str):
            out.append(self.text(p))
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            out.append(len(p))
        elif isinstance(p, list):
            out.extend(len(x) if isinstance(x, list) else self.text(str(x)) for x in p)
        emb = body.get("prompt_embeds")
        for e in [emb] if isinstance(emb, str) else emb if isinstance(emb, list) else []:
            if isinstance(e, str):
                out.append(self.embeds(e))
        return out

    def embeds(self, b64: str) -> int:
        """Estimate: a tensor of N tokens x hidden x dtype bytes, base64 (4 chars per 3 bytes)."""
        per = max(1, self.rules.prompt_embeds_bytes_per_token)
        padding = 2 if b64.endswith("==") else 1 if b64.endswith("=") else 0
        decoded = len(b64) * 3 // 4 - padding
        return -(-decoded // per)


def work_chars(body: dict[str, Any], rules: SizingRules) -> int:
    """Characters that counting ``body`` will tokenize or hash, each field capped.

    Decides inline vs worker thread. Every counted field is included (names, tool-call
    arguments, tool definitions, content parts), and a field past ``max_field_chars`` adds
    only the cap: beyond it the field is sized by its byte length, not tokenized.
    """
    cap = rules.max_field_chars
    total = 0

    def add(value: Any) -> None:
        nonlocal total
        if isinstance(value, str):
            total += min(len(value), cap)
        elif isinstance(value, dict | list):
            # Unknown parts, tool definitions, object arguments: counted as their JSON.
            total += min(len(orjson.dumps(value)), cap)

    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else []:
        if not isinstance(m, dict):
            continue
        for key in ("role", "name", "tool_call_id"):
            add(m.get(key))
        content = m.get("content")
        for part in content if isinstance(content, list) else [content]:
            if isinstance(part, dict) and media_kind(str(part.get("type", ""))) is None:
                add(part.get("text", part.get("refusal", part)))
            elif isinstance(part, str):
                add(part)
        calls = m.get("tool_calls")
        for call in (calls if isinstance(calls, list) else []) + [m.get("function_call")]:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(fn, dict):
                add(fn.get("name"))
                add(fn.get("arguments"))
    for key in ("tools", "functions"):
        tools = body.get(key)
        for t in tools if isinstance(tools, list) else []:
            add(t)
    p = body.get("prompt")
    for x in [p] if isinstance(p, str) else p if isinstance(p, list) else []:
        add(x if isinstance(x, str) else None)
    return total


@functools.cache
def encoding() -> TiktokenCounter:
    """The default counter (cl100k, offline), loaded once; loading takes ~0.4 s."""
    return TiktokenCounter("cl100k_base")


def count_text(text: str) -> int:
    """Tokens of ``text`` with the default encoder (cl100k)."""
    return encoding().count(text)
