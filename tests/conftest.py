"""Shared fixtures: real servers on 127.0.0.1 with free ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.embedded import EmbeddedMesh, start_embedded
from mesh.config import BrokerConfig
from mesh.testing import LocalMesh

_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leaves once the session is over and reported. After it, pytest's final garbage
    collection frees the last grpc.aio objects, and grpc then joins its poller thread, which
    now and then never returns (seen as a hang after "N passed"): nothing is left to do that
    would be worth that risk."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port for the session; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; .ci/run adds it)")
    folder = tmp_path_factory.mktemp("redis")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, emptied of mesh keys before the test."""
    import redis

    client = redis.Redis.from_url(redis_server)
    keys = list(client.scan_iter(match="mesh:*"))
    if keys:
        client.delete(*keys)
    client.close()
    return redis_server
