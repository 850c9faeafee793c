"""Shared fixtures: real servers on 127.0.0.1 with free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.embedded import EmbeddedMesh, start_embedded
from mesh.config import BrokerConfig
from mesh.testing import LocalMesh


@pytest.fixture
async def mesh() -> AsyncIterator[LocalMesh]:
    async with LocalMesh(BrokerConfig(sweep_interval=0.05)) as local:
        yield local


@pytest.fixture
async def embedded(tmp_path: Path) -> AsyncIterator[EmbeddedMesh]:
    """Broker, gateway and every sample agent, each on its own gRPC server."""
    running = await start_embedded(metrics_port=0, reports_dir=tmp_path / "reports")
    try:
        yield running
    finally:
        await running.stop(1.0)
