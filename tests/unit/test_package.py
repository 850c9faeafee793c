"""What importing the packages loads: the pure core and the patterns without gRPC, and every
name `mesh` offers, each from where it lives."""

from __future__ import annotations

import json
import subprocess
import sys

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


def _loaded_after(module: str) -> list[str]:
    """The modules a fresh interpreter holds once it imported ``module``."""
    out = subprocess.run(
        [sys.executable, "-c", f"import json, sys, {module}; print(json.dumps(list(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


@pytest.mark.parametrize("module", PURE)
def test_the_pure_core_and_the_patterns_load_no_grpc(module: str) -> None:
    loaded = _loaded_after(module)
    assert module in loaded
    assert not [name for name in loaded if name == "grpc" or name.startswith("grpc.")]
    assert "mesh.client" not in loaded and "mesh.server" not in loaded


def test_every_name_mesh_offers_is_the_one_of_its_module() -> None:
    import mesh.agent
    import mesh.client
    import mesh.core
    import mesh.core.negotiation
    import mesh.server
    import mesh.testing

    assert mesh.connect is mesh.client.connect
    assert mesh.Agent is sys.modules["mesh.agent"].Agent
    assert mesh.Message is mesh.core.Message
    assert mesh.serve_broker is mesh.server.serve_broker
    assert mesh.LocalMesh is mesh.testing.LocalMesh
    assert mesh.negotiation is mesh.core.negotiation
    for name in mesh.__all__:
        assert getattr(mesh, name) is not None
    assert set(mesh.__all__) <= set(dir(mesh))


def test_mesh_agent_is_the_decorator_whoever_loaded_the_module() -> None:
    """``mesh.agent`` names a module and the decorator both: the decorator it is, in a fresh
    interpreter whichever way the module ``mesh.agent`` was loaded."""
    for first in ("import mesh.agent", "from mesh import LocalMesh", "from mesh import Agent", ""):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                f"{first}\nimport sys, mesh\nfrom mesh import agent\n"
                "m = sys.modules['mesh.agent']\n"
                "print(agent is mesh.agent is m.agent, type(agent).__name__)",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        assert out.stdout.split() == ["True", "function"], first


def test_a_name_mesh_does_not_offer_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'mesh' has no attribute 'Nothing'"):
        _ = mesh.Nothing  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from mesh import Nothing")


def test_a_star_import_of_mesh_gives_every_name() -> None:
    namespace: dict[str, object] = {}
    exec("from mesh import *", namespace)
    assert set(mesh.__all__) <= set(namespace)
