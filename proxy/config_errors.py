"""Config problems worded for the person who wrote the YAML file, all of them in one pass.

pydantic reports ``backends.2.pool`` and "Extra inputs are not permitted"; a user reads
``backends[2] (name: general-1).pool`` and "unknown key (did you mean `pool`?)". This module
turns pydantic's errors and the cross-field checks pydantic cannot run until every field is
valid (unknown pools, duplicate names) into one list of lines, so a user fixes a file in one
round instead of one error per run. List positions count from 0, as in jq and Python; the
item's name is shown next to its position so nobody has to count. Secrets (keys, passwords in
URLs, hook headers) are never echoed back.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel
from pydantic_core import ErrorDetails

Loc = tuple[str | int, ...]

# Keys whose values are secrets: errors say "(value hidden)" instead of echoing them.
SECRET_KEYS = frozenset({"api_key", "api_keys", "redis_url", "headers", "password"})

# pydantic's wording -> ours, by error type. "{x}" fields come from the error's ctx.
_MESSAGES: dict[str, str] = {
    "missing": "required key is missing",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a text string (quote it in YAML)",
    "dict_type": "must be a mapping of keys to values",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
    "list_type": "must be a list",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "too_short": "needs at least {min_length} item(s)",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "url_parsing": "is not a valid URL ({error}); e.g. http://10.0.0.7:8000",
    "url_scheme": "must be an http:// or https:// URL",
}
_PATTERN_HINTS: dict[str, str] = {
    "name": "may contain only letters, digits and _ . : - and must not start with -",
}


def redact_url(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host``; other URLs unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    if parts.password is None and not (parts.username and "@" in parts.netloc):
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    cred = f"{user}:***" if parts.password is not None else "***"
    return urlunsplit(parts._replace(netloc=f"{cred}@{host}"))


def _item_label(data: Any, loc: Loc, i: int) -> str:
    """``backends[2] (name: general-1)`` for list items that have a name."""
    node: Any = data
    for part in loc[: i + 1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
            break
    label = f"[{loc[i]}]"
    if isinstance(node, dict) and isinstance(node.get("name"), str):
        label += f" (name: {node['name']})"
    return label


def format_loc(loc: Loc, data: Any) -> str:
    """A location as a user reads it; list items carry their name when they have one."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += _item_label(data, loc, i)
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _unwrap(annotation: Any) -> Any:
    """The model class inside ``X | None``, ``list[X]``, ``dict[str, X]``, else the annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    if origin in (list, dict):
        return _unwrap(typing.get_args(annotation)[-1])
    return annotation


def model_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model that owns the key at ``loc`` (its parent), to list the valid keys there."""
    model: Any = root
    for part in loc[:-1]:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        if isinstance(part, int) or part not in model.model_fields:
            # A list index or a dict key (pool name): same model continues below it.
            continue
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean `x`?)`` for the closest choice, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _is_secret(loc: Loc) -> bool:
    return any(isinstance(p, str) and p in SECRET_KEYS for p in loc)


def _shown(value: Any, loc: Loc) -> str:
    if isinstance(value, dict | list) or value is None:
        return ""
    if _is_secret(loc):
        return " (value hidden)"
    return f" (got {value!r})"


def _message(err: ErrorDetails, root: type[BaseModel]) -> str:
    kind = err["type"]
    loc: Loc = tuple(err["loc"])
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        owner = model_at(root, loc)
        valid = list(owner.model_fields) if owner is not None else []
        return "unknown key" + did_you_mean(str(loc[-1]), valid)
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        options = re.findall(r"'([^']*)'", expected)
        return f"must be one of {expected}" + did_you_mean(str(err.get("input")), options)
    if kind == "string_pattern_mismatch":
        return _PATTERN_HINTS.get(str(loc[-1]), f"must match {ctx.get('pattern')}")
    if kind in _MESSAGES:
        try:
            return _MESSAGES[kind].format(**ctx)
        except (KeyError, IndexError):
            return _MESSAGES[kind]
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return msg.replace("Input should be", "must be")


def pydantic_problems(
    errors: Iterable[ErrorDetails], data: Any, root: type[BaseModel]
) -> list[str]:
    """Each pydantic error as ``key: message (got value)``."""
    lines = []
    for err in errors:
        loc: Loc = tuple(err["loc"])
        shown = _shown(err.get("input"), loc) if err["type"] != "extra_forbidden" else ""
        lines.append(f"{format_loc(loc, data)}: {_message(err, root)}{shown}")
    return lines


def cross_problems(data: Any) -> list[str]:
    """Checks across keys (pools, duplicate names) run on the raw data, so they are reported
    in the same pass as field errors even when other fields are invalid."""
    if not isinstance(data, dict):
        return []
    pools_raw = data.get("pools", {"general": {}})
    pools = sorted(pools_raw) if isinstance(pools_raw, dict) else []
    lines = []
    discovery = data.get("discovery")
    discovery = discovery if isinstance(discovery, dict) else {}
    dynamic = discovery.get("type", "static") != "static"
    backends = data.get("backends", [])
    if backends in ([], None) and not dynamic:
        lines.append("backends: at least one backend is required (or a discovery section)")
    dpool = discovery.get("pool", "general")
    if (
        dynamic
        and isinstance(dpool, str)
        and isinstance(pools_raw, dict)
        and dpool not in pools_raw
    ):
        lines.append(f"discovery.pool: {dpool!r} is not a defined pool{did_you_mean(dpool, pools)}")
    if not isinstance(backends, list):
        return lines
    seen: set[str] = set()
    for i, b in enumerate(backends):
        if not isinstance(b, dict):
            continue
        name = b.get("name")
        if isinstance(name, str):
            if name in seen:
                where = format_loc(("backends", i, "name"), data)
                lines.append(f"{where}: duplicate backend name {name!r}")
            seen.add(name)
        pool = b.get("pool", "general")
        if isinstance(pool, str) and isinstance(pools_raw, dict) and pool not in pools_raw:
            where = format_loc(("backends", i, "pool"), data)
            hint = did_you_mean(pool, pools)
            lines.append(
                f"{where}: {pool!r} is not a defined pool (defined under `pools`: {', '.join(pools) or 'none'}){hint}"
            )
    return lines


def problems_message(source: str, lines: list[str]) -> str:
    """The whole message: a header with the count, one line per problem."""
    head = f"{source}: {len(lines)} problem(s) (list positions count from 0)"
    return "\n".join([head, *(f"  {line}" for line in lines)])
