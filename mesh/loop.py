"""Which event loop the mesh's processes run on: uvloop when it is installed (a faster loop
that grpc.aio runs on unchanged), else asyncio's own. AGENTMESH_EVENT_LOOP=asyncio forces
the standard loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    if os.environ.get("AGENTMESH_EVENT_LOOP", "") == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs a process's main coroutine on the chosen loop."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
