"""proxy/__init__.py: the public API is complete, resolves to the real objects, and is lazy."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest

import proxy
import proxy.core.fleet
import proxy.errors
import proxy.routing


def test_all_and_the_homes_name_the_same_things() -> None:
    assert sorted(proxy.__all__) == sorted(proxy._HOME)
    assert len(set(proxy.__all__)) == len(proxy.__all__)


@pytest.mark.parametrize("name", proxy.__all__)
def test_each_name_is_the_object_of_its_home_module(name: str) -> None:
    home = importlib.import_module(proxy._HOME[name])
    assert getattr(proxy, name) is getattr(home, name)
    assert name in dir(proxy)


def test_all_is_complete() -> None:
    """Whatever the public modules offer is offered by the package too."""
    exported = set(proxy.__all__)
    errors = {
        name
        for name, obj in vars(proxy.errors).items()
        if inspect.isclass(obj) and issubclass(obj, proxy.errors.KvrouteError)
    }
    fleet = {
        name
        for name, obj in vars(proxy.core.fleet).items()
        if dataclasses.is_dataclass(obj) and obj.__module__ == "proxy.core.fleet"
    }
    missing = (errors | fleet | set(proxy.routing.__all__)) - exported
    assert not missing, f"add to proxy.__all__: {sorted(missing)}"
    assert {"Config", "load_config", "StateStore", "InProcessStore", "RedisStore"} <= exported


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        proxy.no_such_thing  # noqa: B018


def test_importing_the_package_loads_no_io_stack() -> None:
    code = (
        "import sys, proxy, proxy.core.fleet\n"
        "loaded = {'aiohttp', 'redis', 'httpx', 'proxy.gateway', 'proxy.api'} & set(sys.modules)\n"
        "print(sorted(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
