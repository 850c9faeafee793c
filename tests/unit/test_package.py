"""What importing the packages loads: the pure core and the patterns without gRPC, and every
name `mesh` offers, each from where it lives."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mesh

PURE = [
    "mesh.core",
    "mesh.core.broker",
    "mesh.core.queue",
    "mesh.core.validation",
    "gateway",
    "gateway.patterns.group_chat",
    "gateway.patterns.handoff",
    "gateway.patterns.collaborative",
    "gateway.patterns.consensus",
    "gateway.patterns.research",
    "gateway.patterns.orchestrator",
]


def _fresh(code: str) -> str:
    """What a fresh interpreter running ``code`` prints."""
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout


def _loaded_after(module: str) -> list[str]:
    """The modules a fresh interpreter holds once it imported ``module``."""
    loaded: list[str] = json.loads(
        _fresh(f"import json, sys, {module}; print(json.dumps(list(sys.modules)))")
    )
    return loaded


@pytest.mark.parametrize("module", PURE)
def test_the_pure_core_and_the_patterns_load_no_grpc(module: str) -> None:
    loaded = _loaded_after(module)
    assert module in loaded
    assert not [name for name in loaded if name == "grpc" or name.startswith("grpc.")]
    assert "mesh.client" not in loaded and "mesh.server" not in loaded


def _declared() -> dict[str, str]:
    """Each name `mesh` declares (its imports for type checkers), by the module it names."""
    tree = ast.parse(Path(mesh.__file__).read_text())
    declared = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mesh."):
            declared.update({alias.name: node.module for alias in node.names})
    return declared


def test_every_name_mesh_offers_is_the_one_it_declares() -> None:
    declared = _declared()
    assert sorted(declared) == sorted(mesh.__all__)
    for name, module in declared.items():
        assert getattr(mesh, name) is getattr(importlib.import_module(module), name), name
    assert set(mesh.__all__) <= set(dir(mesh))


def test_mesh_agent_is_the_decorator_whoever_loaded_the_module() -> None:
    """``mesh.agent`` names a module and the decorator both: the decorator it is, in a fresh
    interpreter whichever way the module ``mesh.agent`` was loaded; every other submodule is
    itself."""
    for first in ("import mesh.agent", "from mesh import LocalMesh", "from mesh import Agent", ""):
        out = _fresh(
            f"{first}\nimport sys, mesh\nfrom mesh import agent\n"
            "m = sys.modules['mesh.agent']\nimport mesh.redis_store, mesh.codec\n"
            "print(agent is mesh.agent is m.agent, type(agent).__name__,"
            " mesh.redis_store.__name__, mesh.codec.__name__)"
        )
        assert out.split() == ["True", "function", "mesh.redis_store", "mesh.codec"], first


def test_a_name_mesh_does_not_offer_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'mesh' has no attribute 'Nothing'"):
        _ = mesh.Nothing  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from mesh import Nothing")


def test_a_star_import_of_mesh_gives_every_name() -> None:
    namespace: dict[str, object] = {}
    exec("from mesh import *", namespace)
    assert set(mesh.__all__) <= set(namespace)


async def test_a_plain_with_on_what_takes_async_with_says_to_use_async_with() -> None:
    """A mistake every new asyncio user makes, inside a coroutine: `with connect(...)` (as
    aiohttp says of its session, the error names the fix)."""
    from gateway.client import GatewayClient
    from mesh.testing import LocalMesh

    refused = r"is asynchronous: use 'async with', in an async def"
    with pytest.raises(TypeError, match=refused), LocalMesh():
        pass
    for made in (
        mesh.connect("127.0.0.1:1", agent_id="X"),
        mesh.AgentClient("127.0.0.1:1"),
        GatewayClient("127.0.0.1:1"),
    ):
        try:
            with pytest.raises(TypeError, match=refused), made:
                pass
        finally:
            await made.__aexit__(None, None, None)  # (its channel, closed)


async def test_a_client_closed_before_its_first_call_refuses_every_call_as_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its channel is made on first use: closed first, it makes none (none left open), and
    says why."""
    import mesh.client

    made: list[str] = []
    monkeypatch.setattr(mesh.client, "open_channel", lambda target, *_: made.append(target))
    client = mesh.connect("127.0.0.1:1", agent_id="X")
    await client.close()
    for call in (client.list_agents(), client.send("A", {"action": "x"})):
        with pytest.raises(mesh.SessionClosedError, match="this client is closed: connect again"):
            await call
    assert made == []
