"""Real llama.cpp servers for tests (``loadtest.llama_fleet``), skipped or failed when absent.

Without the two packages the tests skip, saying how to install them; with
``KVROUTE_REQUIRE_LLAMACPP=1`` (set by ``.ci/run``, which installs both) they fail instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from loadtest.llama_fleet import MODEL_ALIAS as MODEL_ALIAS
from loadtest.llama_fleet import LlamaServer as LlamaServer
from loadtest.llama_fleet import find_llama, start_servers, stop_server
from loadtest.llama_fleet import model_path as model_path


def require_llama() -> tuple[str, Path]:
    """The server command and the model, or skip (fail in CI) saying how to install them."""
    found = find_llama()
    if not isinstance(found, str):
        return found
    if os.environ.get("KVROUTE_REQUIRE_LLAMACPP") == "1":
        pytest.fail(f"{found} and KVROUTE_REQUIRE_LLAMACPP=1", pytrace=False)
    pytest.skip(found)


@contextlib.contextmanager
def llama_servers(*layouts: Sequence[str]) -> Iterator[list[LlamaServer]]:
    """Start one server per ``layouts`` entry (extra flags, e.g. ``["-c", "2048", "-np", "4",
    "--kv-unified"]``), all at once; yield them once each answers ``/health`` with 200."""
    binary, model = require_llama()
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-llama-"))
    servers: list[LlamaServer] = []
    try:
        servers = start_servers(binary, model, layouts, workdir)
        yield servers
    finally:
        for s in servers:
            stop_server(s)
        shutil.rmtree(workdir, ignore_errors=True)
