"""`python -m benchmarks` as `make bench` runs it: a quick run of the whole harness (a mesh in
separate processes, the raw gRPC baselines) writes every figure, and compares with an earlier
result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import BENCH_GO, build_meshgo, go_available, node_available
from gateway.demo import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "latest.json"

pytestmark = pytest.mark.processes

LATENCIES = (
    "baseline.hop1",
    "baseline.relay2",
    "baseline.contract2",
    "baseline.fanout5",
    "send",
    "receive",
    "roundtrip",
    "roundtrip_raw_ends",
    "handoff",
    "broadcast5",
    "broadcast5_raw_ends",
    "broadcast100",
    "routing",
    "group_chat",
    "roundtrip_filling",
    *(f"pattern.{scenario.name}" for scenario in SCENARIOS),
    # Polyglot: from the Node.js client, and to an agent in Node.js.
    *(("node_client.roundtrip", "node_agent.roundtrip") if node_available() else ()),
    *(("go_agent.roundtrip",) if go_available() else ()),
    "push_agent.roundtrip",
)
THROUGHPUTS = ("oneway_1", "oneway_16", "oneway_64", "oneway_batch100")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.timeout(600)  # (a whole run of the harness: 35 s alone, 4x that on a busy host)
def test_a_quick_run_writes_every_figure_and_compares_with_an_earlier_result(
    tmp_path: Path,
) -> None:
    earlier = json.loads(COMMITTED.read_text())
    earlier["figures"]["roundtrip"]["p50_ms"] = 1000.0  # a slow past, to be compared with
    earlier_file = tmp_path / "earlier.json"
    earlier_file.write_text(json.dumps(earlier))
    committed = COMMITTED.read_bytes()
    out = tmp_path / "results"
    if go_available():  # (a quick run compiles none: it takes the meshgo a full run built)
        build_meshgo(BENCH_GO)

    run = bench("--quick", "--output", str(out), "--compare", str(earlier_file))

    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "latest.json").read_text())
    figures = report["figures"]
    for name in LATENCIES:
        f = figures[name]
        assert 0 < f["p50_ms"] <= f["p95_ms"] <= f["p99_ms"] <= f["max_ms"], name
        relay = figures["baseline.relay2"]
        assert f["x_relay2_p50"] == pytest.approx(f["p50_ms"] / relay["p50_ms"]), name
        assert f["x_relay2_p95"] == pytest.approx(f["p95_ms"] / relay["p95_ms"]), name
    for name in ("baseline.relay2", "roundtrip_raw_ends", "roundtrip"):  # drawn whole
        q = figures[name]["quantiles_ms"]
        assert len(q) == 101 and q == sorted(q) and q[50] == figures[name]["p50_ms"], name
    # The backlog beside roundtrip_filling grew while it was measured, and the report says how.
    assert figures["roundtrip_filling"]["fill_throughput"] > 0
    assert (
        "while four senders fill the queue of an agent nobody consumes"
        in (out / "latest.md").read_text()
    )
    for name in THROUGHPUTS:
        assert figures[name]["throughput"] > 0, name
    # Each number also under its plain dotted name, at the top level.
    assert report["roundtrip.p95_ms"] == figures["roundtrip"]["p95_ms"]
    assert report["baseline.relay2.p95_ms"] == figures["baseline.relay2"]["p95_ms"]
    assert report["roundtrip.x_relay2_p50"] == figures["roundtrip"]["x_relay2_p50"]
    assert report["oneway_batch100.throughput"] == figures["oneway_batch100"]["throughput"]
    assert (
        report["roundtrip.cpu_us_per_op.broker"] == figures["roundtrip"]["cpu_us_per_op"]["broker"]
    )
    hot = report["hotpath"]  # the Python of each path, without gRPC
    assert hot["broker_roundtrip_us"] > hot["raw_loop_us"] > 0
    assert hot["agent_message_us"] > hot["raw_loop_us"] and hot["client_request_us"] > 0
    assert report["hotpath.broker_roundtrip_us"] == hot["broker_roundtrip_us"]
    assert figures["roundtrip"]["throughput_64"] > 0
    assert figures["roundtrip"]["x_relay2_throughput_64"] == pytest.approx(
        figures["roundtrip"]["throughput_64"] / figures["baseline.relay2"]["throughput_64"]
    )
    assert report["settings"]["quick"] is True
    assert report["machine"]["cpus"] >= 1 and report["machine"]["python"]
    checks = {c["figure"]: c for c in report["checks"]}
    for figure in ("send.p95_ms", "roundtrip.p95_ms", "handoff.p95_ms", "broadcast5.p50_ms"):
        assert isinstance(checks[figure]["pass"], bool), figure
        assert checks[figure]["value"] == pytest.approx(
            figures[figure.split(".")[0]][figure.split(".")[1]]
        )
    table = (out / "latest.md").read_text()
    assert "| figure | p50 ms | p95 ms | p99 ms | max ms | x relay p50 | throughput/s |" in table
    assert "| roundtrip |" in table and "| baseline.relay2 |" in table
    assert "The broker's share of a roundtrip:" in table
    assert "The mesh's own Python per operation, without gRPC" in table
    assert f"Compared with {earlier_file}:" in run.stdout
    assert "roundtrip.p50_ms: 1000.000 -> " in run.stdout and "faster)" in run.stdout
    png = out / "latest.png"  # (make setup installs matplotlib, the bench extra)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert COMMITTED.read_bytes() == committed  # written to --output only


def test_a_mistake_in_the_options_ends_the_run_before_it_measures(tmp_path: Path) -> None:
    out = tmp_path / "results"
    for args, said in (
        (["--compare", str(tmp_path / "missing.json")], "--compare: cannot read"),
        (["--compare", str(ROOT / "README.md")], "--compare: cannot read"),
        (["--compare", str(ROOT / "pyproject.toml")], "--compare: cannot read"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ):
        run = bench("--output", str(out), *args)
        assert run.returncode == 2, run
        assert said in run.stderr, run.stderr
    not_a_result = tmp_path / "other.json"
    not_a_result.write_text('{"a": 1}')
    run = bench("--output", str(out), "--compare", str(not_a_result))
    assert run.returncode == 2 and "is not a benchmark result" in run.stderr
    assert not out.exists()  # nothing measured, nothing written
    helped = bench("--help")
    assert helped.returncode == 0 and "--quick" in helped.stdout and "--compare" in helped.stdout
