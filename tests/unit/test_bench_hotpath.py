"""`python -m benchmarks.hotpath`: each path really runs end to end against the in-memory
streams (a request answered, a delivery answered), and costs more than the bare loop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import hotpath

ROOT = Path(__file__).resolve().parents[2]


async def test_every_path_completes_its_operations_and_costs_more_than_the_bare_loop() -> None:
    # The least of three runs: a busy moment of the machine only ever adds time, and one
    # run of the bare loop caught by one (29.5 us where it takes 5) was above a batch's.
    figures = await asyncio.wait_for(hotpath.measure(200, repetitions=3), 90)
    assert set(figures) == {
        "broker_roundtrip_us",
        "broker_gather5_us",
        "broker_batched_us",
        "agent_message_us",
        "client_request_us",
        "raw_loop_us",
    }
    floor = figures["raw_loop_us"]
    assert floor > 0
    for name in ("broker_roundtrip_us", "agent_message_us", "client_request_us"):
        assert figures[name] > floor, name
    # Five deliveries and five answers cost more than one of each; a message of a batch
    # shares its call, its frames and its ack with 99 others: less than a roundtrip.
    assert figures["broker_gather5_us"] > figures["broker_roundtrip_us"]
    assert floor < figures["broker_batched_us"] < figures["broker_roundtrip_us"]


def test_the_command_prints_the_figures_as_json() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", "--json", "--count=100", "--repetitions=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(run.stdout)
    assert figures["broker_roundtrip_us"] > figures["raw_loop_us"] > 0
    assert "Task was destroyed" not in run.stderr


@pytest.mark.parametrize("flag", ["--count", "--repetitions"])
def test_the_command_refuses_a_count_of_no_runs(flag: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", flag, "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--count and --repetitions must be at least 1" in run.stderr


def test_one_path_is_profiled_with_its_call_tree_and_a_page(tmp_path: Path) -> None:
    command = ["-m", "benchmarks.hotpath", "--profile", "client_request", "--count", "300"]
    run = subprocess.run(
        [sys.executable, *command, "--profile-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    page = tmp_path / "hotpath.client_request.html"
    assert run.stdout.rstrip().endswith(f"wrote {page}")
    # The SDK's request() and what it calls, with their share of the time.
    assert "MeshClient.request  mesh/client.py" in run.stdout
    assert "message_to_pb  mesh/codec.py" in run.stdout
    assert "<html" in page.read_text()[:1000].lower()
    unknown = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", "--profile", "broker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "invalid choice: 'broker'" in unknown.stderr
