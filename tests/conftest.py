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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(folder: Path, *options: str) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server in ``folder`` on a free port, once it takes connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; .ci/run adds it)")
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir"]
    process = subprocess.Popen(
        [*command, str(folder), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return process, port
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port for the session; its URL."""
    process, port = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A real three-node Redis Cluster (16384 slots over three primaries, made by
    ``redis-cli --cluster create``) for the session; its nodes' URLs."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (Debian package redis-tools; .ci/run adds it)")
    folder = tmp_path_factory.mktemp("redis-cluster")
    nodes: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for n in range(3):
            nodes.append(
                _start_redis(
                    folder / str(n),
                    "--cluster-port",  # the bus: by default port + 10000, maybe out of range
                    str(_free_port()),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--appendonly",
                    "no",
                )
            )
        subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{port}" for _, port in nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(port) for _, port in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.1)
        yield [f"redis://127.0.0.1:{port}/0" for _, port in nodes]
    finally:
        for process, _ in nodes:
            process.terminate()
        for process, _ in nodes:
            process.wait(10)


def _cluster_ok(port: int) -> bool:
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
    ).stdout
    return "cluster_state:ok" in info


@pytest.fixture
def redis_cluster_url(redis_cluster: list[str]) -> str:
    """The session's Redis Cluster, emptied before the test; the URL of one of its nodes."""
    import redis

    for url in redis_cluster:
        client = redis.Redis.from_url(url)
        client.flushall()
        client.close()
    return redis_cluster[0]


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
