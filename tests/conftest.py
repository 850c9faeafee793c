"""Shared fixtures: real servers on 127.0.0.1 with free ports."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.embedded import EmbeddedMesh, start_embedded
from mesh.config import BrokerConfig
from mesh.logs import stop_logging
from mesh.testing import LocalMesh, LocalRedis
from tests.helpers.programs import flush_mesh_keys

_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """The root logger's handlers and level as before each test. A command run in-process
    (``mesh.cli.main``) configures logging to the stderr pytest captured for that test: left
    in place, every record later tests of the worker log at INFO meets a closed file, and
    logging prints a traceback for each."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    stop_logging()
    root.handlers[:] = handlers
    root.setLevel(level)


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
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    redis = LocalRedis.start(tmp_path_factory.mktemp("redis"))
    try:
        yield redis.url
    finally:
        redis.stop()


@pytest.fixture(scope="session")
def local_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A real three-node Redis Cluster (16384 slots over three primaries, made by
    ``redis-cli --cluster create``) for the session."""
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    cluster = LocalRedis.start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(local_redis_cluster: LocalRedis) -> list[str]:
    """The session's Redis Cluster, emptied before the test; its nodes' URLs."""
    local_redis_cluster.flush()
    return local_redis_cluster.urls


@pytest.fixture
def redis_cluster_url(redis_cluster: list[str]) -> str:
    """The session's Redis Cluster, emptied before the test; the URL of one of its nodes."""
    return redis_cluster[0]


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, emptied of mesh keys before the test."""
    flush_mesh_keys(redis_server)
    return redis_server


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    """An SDK tracer provider that keeps spans in memory (installed once per process, for the
    rest of the session: a test that wants no provider runs in a process of its own)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # another test may have installed one
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
