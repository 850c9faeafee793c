"""Shared fixtures: a real broker server on 127.0.0.1 with a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from mesh.config import BrokerConfig
from mesh.testing import LocalMesh


@pytest.fixture
async def mesh() -> AsyncIterator[LocalMesh]:
    async with LocalMesh(BrokerConfig(sweep_interval=0.05)) as local:
        yield local
