"""What the tests of random programs share: their Hypothesis settings, and a clean Redis."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings


def programs_settings(examples: int) -> Any:
    """Settings for a test of random programs: ``examples`` programs (times
    AGENTMESH_PROGRAMS_SCALE, for a longer search than the suite's), no deadline (each runs
    real servers), and the fixture a test receives shared by its programs."""
    return settings(
        max_examples=examples * int(os.environ.get("AGENTMESH_PROGRAMS_SCALE", "1")),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def flush_mesh_keys(*urls: str) -> None:
    """Takes the mesh's keys out of a Redis server, or out of each node of a cluster."""
    import redis

    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            pipe = client.pipeline(transaction=False)  # (a key at a time: a cluster's
            for key in client.scan_iter(match="mesh:*"):  # keys are in many slots)
                pipe.delete(key)
            pipe.execute()
        finally:
            client.close()
