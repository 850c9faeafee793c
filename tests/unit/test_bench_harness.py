"""The benchmark harness's accounting: CPU per operation read from real processes, medians over
repetitions, and what the report and the comparison say."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest

from benchmarks import harness
from benchmarks.harness import (
    SIDE_BY_SIDE,
    CpuMeter,
    Settings,
    combine,
    compare,
    cpu_table,
    current_meshgo,
    draw,
    evaluate,
    jit_warmup,
    measured_in_turns,
    memory_by_role,
    memory_lines,
    paired,
    process_cpu_seconds,
    process_memory_mb,
    spawn,
    timed,
    to_markdown,
    warm_up,
    with_ratios,
)

BURN = """import time
end = time.process_time() + {seconds}
while time.process_time() < end:
    pass
print("ready", flush=True)
time.sleep(60)
"""

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def burner(seconds: float) -> subprocess.Popen[bytes]:
    """A process that spends ``seconds`` of CPU, says so, then sleeps until killed."""
    child = subprocess.Popen([sys.executable, "-c", BURN.format(seconds=seconds)], stdout=PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


@linux_only
def test_a_process_cpu_time_is_read_from_proc() -> None:
    child = burner(0.3)
    try:
        spent = process_cpu_seconds(child.pid)
        assert spent is not None
        assert 0.3 <= spent < 1.0  # the loop, and the interpreter's start-up
        time.sleep(0.2)  # asleep now: no more CPU
        assert process_cpu_seconds(child.pid) == pytest.approx(spent, abs=0.03)
    finally:
        child.kill()
        child.wait()
    assert process_cpu_seconds(child.pid) is None  # gone


HOLD = """import time
held = bytearray({mb} * 1024 * 1024)
print("ready", flush=True)
time.sleep(60)
"""


@linux_only
def test_memory_is_read_from_proc_by_role() -> None:
    """A process holding 80 MiB reads as at least that; a role shows its largest process."""
    small, large = (
        subprocess.Popen([sys.executable, "-c", HOLD.format(mb=mb)], stdout=PIPE) for mb in (0, 80)
    )
    try:
        for child in (small, large):
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        read = process_memory_mb(large.pid)
        assert read is not None
        resident, peak = read
        assert 80 <= resident <= peak < 200
        by_role = memory_by_role({"broker": [small.pid], "agents": [small.pid, large.pid]})
        assert by_role is not None
        assert by_role["agents_mb"] == round(resident, 1)
        assert by_role["broker_mb"] < 80 and by_role["broker_peak_mb"] < 80
    finally:
        for child in (small, large):
            child.kill()
            child.wait()
    assert process_memory_mb(large.pid) is None
    assert memory_by_role({"broker": [large.pid]}) is None


def test_the_report_shows_memory_after_each_repetition() -> None:
    after = [
        {"broker_mb": 60.0, "broker_peak_mb": 70.0, "agents_mb": 50.0},
        {"broker_mb": 61.5, "broker_peak_mb": 72.0, "agents_mb": 50.2},
    ]
    lines = memory_lines({"after_each_repetition": after})
    assert "| after | broker | broker_peak | agents |" in lines
    assert lines[-2:] == [
        "| repetition 1 | 60.0 | 70.0 | 50.0 |",
        "| repetition 2 | 61.5 | 72.0 | 50.2 |",
    ]
    assert memory_lines(None) == []


@linux_only
def test_the_meter_divides_each_role_cpu_by_the_operations() -> None:
    one, two = burner(0.0), burner(0.0)  # started, and asleep from now on
    try:
        meter = CpuMeter({"broker": [one.pid], "agents": [two.pid]})
        before = meter.read()
        end = time.process_time() + 0.2
        while time.process_time() < end:  # the driver (this process) works
            pass
        cost = CpuMeter.cost(before, meter.read(), 100)
    finally:
        for child in (one, two):
            child.kill()
            child.wait()
    assert cost is not None
    assert set(cost) == {"driver", "broker", "agents", "total"}
    assert cost["driver"] == pytest.approx(2000, rel=0.2)  # 0.2 s over 100 operations
    assert cost["broker"] <= 200 and cost["agents"] <= 200  # asleep: at most a tick or two
    assert cost["total"] == pytest.approx(cost["driver"] + cost["broker"] + cost["agents"], abs=0.5)


def test_a_meter_that_cannot_read_gives_no_cost() -> None:
    meter = CpuMeter({"broker": [2**22 + 12345]})  # no such process
    assert meter.read() is None
    assert CpuMeter.cost(None, {"driver": 1.0}, 10) is None
    assert CpuMeter.cost({"driver": 0.0}, {"driver": 1.0}, 0) is None


def run(p50: float, broker: float, *, read: bool = True) -> dict[str, dict[str, object]]:
    cost = {"driver": 100.0, "broker": broker, "total": 100.0 + broker} if read else None
    return {"roundtrip": {"p50_ms": p50, "cpu_us_per_op": cost}}


def test_repetitions_combine_to_the_median_of_each_role() -> None:
    combined = combine([run(1.0, 500.0), run(3.0, 700.0), run(2.0, 900.0)])
    assert combined["roundtrip"]["p50_ms"] == 2.0
    assert combined["roundtrip"]["p50_ms_spread"] == [1.0, 3.0]
    assert combined["roundtrip"]["cpu_us_per_op"] == {
        "driver": 100.0,
        "broker": 700.0,
        "total": 800.0,
    }
    unread = combine([run(1.0, 500.0), run(2.0, 600.0, read=False)])
    assert unread["roundtrip"]["cpu_us_per_op"] is None


def test_the_quantiles_of_repetitions_combine_to_the_median_of_each() -> None:
    runs = [
        {"roundtrip": {"quantiles_ms": [q, q + d, q + 2 * d]}} for q, d in ((1, 1), (3, 5), (2, 2))
    ]
    assert combine(runs)["roundtrip"]["quantiles_ms"] == [2, 4, 6]


def test_the_cpu_table_sets_each_figure_beside_the_relay_at_the_same_load() -> None:
    figures = {
        "baseline.relay2": {
            "p50_ms": 0.5,
            "cpu_us_per_op": {"driver": 200.0, "relay": 300.0, "echo": 100.0, "total": 600.0},
            "cpu_us_per_op_64": {"driver": 150.0, "relay": 250.0, "echo": 100.0, "total": 500.0},
        },
        "roundtrip": {
            "p50_ms": 1.2,
            "cpu_us_per_op": {"driver": 400.0, "broker": 700.0, "agents": 100.0, "total": 1200.0},
            "cpu_us_per_op_64": {"driver": 100.0, "broker": 100.0, "agents": 50.0, "total": 250.0},
        },
        "oneway_16": {"throughput": 5000.0, "cpu_us_per_op": None},
    }
    table = "\n".join(cpu_table(figures))
    assert "| figure | total | x relay | driver | relay | echo | broker | agents |" in table
    assert "| roundtrip | 1,200.0 | 2.00 | 400.0 |  |  | 700.0 | 100.0 |" in table
    assert "| roundtrip (64 in flight) | 250.0 | 0.50 | 100.0 |  |  | 100.0 | 50.0 |" in table
    assert "oneway_16" not in table  # no CPU figure: no row
    assert cpu_table({"oneway_16": {"throughput": 5000.0}}) == []


def test_the_comparison_names_what_got_cheaper_or_dearer() -> None:
    earlier = {"figures": combine([run(2.0, 900.0)])}
    now = {"figures": combine([run(1.0, 500.0)])}
    lines = compare(now, earlier)
    assert "roundtrip.p50_ms: 2.000 -> 1.000 (-50%, faster)" in lines
    assert "roundtrip.cpu_us_per_op.total: 1000.0 -> 600.0 (-40%, cheaper)" in lines
    same = compare(now, {"figures": combine([run(1.01, 510.0)])})
    assert same == ["no figure moved by 5% or more"]


def test_a_comparison_across_machines_reads_each_latency_beside_its_own_relay() -> None:
    earlier = {"figures": with_ratios(repetition(0.4, 0.88))}  # 2.2x its relay
    slower_machine = {"figures": with_ratios(repetition(0.8, 1.6))}  # 2x its relay
    lines = compare(slower_machine, earlier)
    assert lines[0] == (
        "the raw relay itself moved +100% (baseline.relay2.p50_ms 0.400 -> 0.800): another "
        "machine, or a busier one; the x_relay2_p50 lines set the mesh beside the relay of "
        "each run"
    )
    assert "roundtrip.p50_ms: 0.880 -> 1.600 (+82%, slower)" in lines
    assert "roundtrip.x_relay2_p50: 2.20 -> 2.00 (-9%, faster beside the relay)" in lines
    assert not [line for line in lines if line.startswith("baseline.relay2.x_relay2")]
    # On one machine, a relay within a fifth of the earlier one's is not remarked upon.
    near = compare({"figures": with_ratios(repetition(0.44, 0.88))}, earlier)
    assert not [line for line in near if "the raw relay itself" in line]
    assert "roundtrip.x_relay2_p50: 2.20 -> 2.00 (-9%, faster beside the relay)" in near


async def test_an_operation_may_report_the_latency_it_measured_itself() -> None:
    calls = 0

    async def op() -> float:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        return 0.25  # e.g. until the last agent had a broadcast, from the agents' stamps

    assert await timed(op, 3, 2, own_latency=True) == [0.25, 0.25, 0.25]
    assert calls == 5  # the warm-up is run, not sampled
    assert all(0 <= s < 0.25 for s in await timed(op, 2, 0))  # otherwise: its duration


async def test_a_warm_up_runs_every_operation_so_many_at_a_time() -> None:
    running = most = calls = 0

    async def op() -> None:
        nonlocal running, most, calls
        calls += 1
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001)
        running -= 1

    await warm_up(op, 50, 16)
    assert (calls, most) == (50, 16)
    calls = most = 0
    await warm_up(op, 3, 16)  # no more workers than operations
    assert (calls, most) == (3, 3)
    calls = most = 0
    await warm_up(op, 0, 16)
    assert calls == 0


async def test_operations_measured_side_by_side_take_turns_in_blocks() -> None:
    order: list[str] = []

    def op(name: str, seconds: float) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            order.append(name)
            await asyncio.sleep(seconds)

        return run

    meter = CpuMeter({})  # the driver alone: this process
    figures = await measured_in_turns(
        {"relay": (op("relay", 0.001), meter), "mesh": (op("mesh", 0.003), meter)},
        5,
        2,
        block=2,
    )
    # Warm-up for each, then 2, 2 and the last 1 of each in turn.
    assert order == ["relay"] * 2 + ["mesh"] * 2 + ["relay", "relay", "mesh", "mesh"] * 2 + [
        "relay",
        "mesh",
    ]
    assert figures["relay"]["n"] == figures["mesh"]["n"] == 5
    assert 1 <= figures["relay"]["p50_ms"] < figures["mesh"]["p50_ms"]
    for figure in figures.values():  # each distribution whole, as percentiles 0 to 100
        q = figure["quantiles_ms"]
        assert len(q) == 101 and q == sorted(q)
        assert (q[50], q[95], q[99], q[100]) == (
            figure["p50_ms"],
            figure["p95_ms"],
            figure["p99_ms"],
            figure["max_ms"],
        )
    for figure in figures.values():
        cost = figure["cpu_us_per_op"]
        assert cost is not None and set(cost) == {"driver", "total"}
        assert 0 < cost["driver"] == cost["total"]


def repetition(relay_p50: float, roundtrip_p50: float) -> dict[str, dict[str, Any]]:
    """The figures of one repetition, the relay and the roundtrip measured side by side."""

    def latency(p50: float, p95: float) -> dict[str, Any]:
        return {"p50_ms": p50, "p95_ms": p95, "p99_ms": p95, "max_ms": p95, "mean_ms": p50}

    figures: dict[str, dict[str, Any]] = {
        name: latency(0.5, 0.6)
        for name in ("send", "receive", "handoff", "broadcast5_send", "broadcast5", "routing")
    }
    figures["broadcast100"] = latency(8.0, 9.0)
    figures["baseline.relay2"] = latency(relay_p50, 2 * relay_p50)
    figures["roundtrip"] = latency(roundtrip_p50, 3 * roundtrip_p50)
    paired(figures)
    figures["baseline.relay2"]["throughput_64"] = 3000.0
    figures["roundtrip"]["throughput_64"] = 4000.0
    figures["roundtrip_traced"] = {
        **latency(1.1 * roundtrip_p50, 3.3 * roundtrip_p50),
        "overhead": 0.05,
        "sampled_10pct_overhead": 0.01,
    }
    figures["oneway_batch100"] = {"throughput": 21000.0}
    figures["pattern.group_chat"] = latency(9.0, 12.0)
    figures["pattern.handoff"] = latency(12.0, 15.0)
    figures["pattern.pattern_switch"] = latency(17.0, 21.0)
    figures["pattern.collaborative_filtering"] = latency(11.0, 14.0)
    figures["pattern.research"] = latency(55.0, 70.0)
    return figures


def test_a_ratio_to_the_relay_beside_it_is_the_median_of_the_repetitions_ratios() -> None:
    # The machine was slower in the second repetition, for both figures alike: the ratio of
    # the medians (1.5 / 0.6 = 2.5x) would set one repetition's roundtrip beside another's
    # relay; each repetition's own ratio says 2x twice.
    figures = combine([repetition(0.5, 1.0), repetition(0.9, 1.8), repetition(0.6, 1.5)])
    assert figures["roundtrip"]["x_relay2_p50"] == pytest.approx(2.0)
    assert figures["roundtrip"]["x_relay2_p50_spread"] == pytest.approx([2.0, 2.5])
    figures = with_ratios(figures)
    # The cost of tracing is measured beside tracing off, repetition by repetition, too.
    figures["roundtrip_traced"]["overhead_spread"] = [0.03, 0.08]
    checks = {c["figure"]: c for c in evaluate(figures)}
    traced = checks["roundtrip_traced.overhead"]
    assert traced["value"] == pytest.approx(0.05) and traced["pass"] is True
    assert traced["spread"] == [0.03, 0.08]
    assert "spread" not in checks["roundtrip_traced.sampled_10pct_overhead"]
    p50 = checks["roundtrip.p50_ms / baseline.relay2.p50_ms"]
    assert p50["value"] == pytest.approx(2.0) and p50["pass"] is False
    assert p50["spread"] == pytest.approx([2.0, 2.5])
    p95 = checks["roundtrip.p95_ms / baseline.relay2.p95_ms"]
    assert p95["value"] == pytest.approx(3.0) and p95["pass"] is False
    report = {
        "timestamp": "2026-11-24T00:00:00+00:00",
        "machine": {"platform": "Linux", "cpus": 2, "python": "3.11", "grpcio": "1"},
        "settings": {"repetitions": 3, "operations": 2000, "warmup": 200},
        "figures": figures,
        "checks": list(checks.values()),
    }
    markdown = to_markdown(report)
    assert "| roundtrip | 1.500 | 4.500 | 4.500 | 4.500 | 2.00 | 4,000 (64 in flight) |" in markdown
    assert (
        "| roundtrip p50 <= 1.5x relay (`roundtrip.p50_ms / baseline.relay2.p50_ms`) "
        "| 2.000 (2.00 to 2.50) | <= 1.5x | FAIL |" in markdown
    )
    assert "(`roundtrip_traced.overhead`) | 0.050 (0.03 to 0.08) | < 0.15 | PASS |" in markdown


def test_the_report_sets_the_roundtrip_beside_the_least_the_contract_costs() -> None:
    report = {
        "timestamp": "2026-11-23T00:00:00+00:00",
        "machine": {"platform": "Linux", "cpus": 2, "python": "3.11", "grpcio": "1"},
        "settings": {"repetitions": 1, "operations": 10, "warmup": 1},
        "figures": with_ratios(
            {
                name: {"p50_ms": p50, "p95_ms": p50, "p99_ms": p50, "max_ms": p50}
                for name, p50 in (
                    ("baseline.relay2", 0.5),
                    ("baseline.contract2", 0.6),
                    ("roundtrip", 1.5),
                )
            }
        ),
        "checks": [],
    }
    text = to_markdown(report)
    assert "is at p50 0.600 ms (`baseline.contract2`, 1.20x the relay)" in text
    assert "roundtrip takes 2.50x that." in text
    del report["figures"]["baseline.contract2"]  # an earlier result has no such figure
    assert "baseline.contract2" not in to_markdown(report)


def test_the_pattern_targets_are_rf010s_with_a_10x_margin() -> None:
    figures = with_ratios(combine([repetition(0.5, 1.0)]))
    checks = {c["figure"]: c for c in evaluate(figures)}
    switch = checks["pattern.pattern_switch.p50_ms - pattern.handoff.p50_ms"]
    assert switch["value"] == pytest.approx(5.0) and switch["pass"] is True
    slowest = checks["pattern.research.p95_ms"]  # the slowest pattern stands for them all
    assert slowest["value"] == pytest.approx(70.0) and slowest["target"] == "< 2000"
    assert checks["pattern.handoff.mean_ms"]["target"] == "< 1500"
    assert checks["pattern.group_chat.mean_ms"]["pass"] is True

    figures["pattern.pattern_switch"]["p50_ms"] = 250.0  # the switch cost the workflow 238 ms
    figures["pattern.research"]["p95_ms"] = 2500.0
    checks = {c["figure"]: c for c in evaluate(figures)}
    assert checks["pattern.pattern_switch.p50_ms - pattern.handoff.p50_ms"]["pass"] is False
    assert checks["pattern.research.p95_ms"]["pass"] is False


NEVER_READY = """import os, pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(60)
"""


async def test_a_process_whose_start_is_given_up_is_not_left_running(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "logs_folder", lambda: tmp_path)  # (its log goes there)
    pid_file = tmp_path / "pid"
    starting = asyncio.create_task(spawn("-c", NEVER_READY, str(pid_file), ready=r"never printed"))
    async with asyncio.timeout(30):
        while not pid_file.exists() or not pid_file.read_text():  # noqa: ASYNC110 - a file
            await asyncio.sleep(0.01)
    starting.cancel()  # (as a TaskGroup does when another process of the mesh fails)
    with pytest.raises(asyncio.CancelledError):
        await starting
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process any more
        os.kill(int(pid_file.read_text()), 0)


def test_a_node_process_is_warmed_up_for_its_jit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BENCH_QUICK", raising=False)
    full = Settings.from_env()
    warm: set[str] = set()
    # The first repetition: as many requests as V8 takes to compile the hot code.
    assert jit_warmup(warm, "node_agent.roundtrip", full) == full.jit_warmup == 5_000
    assert jit_warmup(warm, "node_client.roundtrip", full) == 5_000
    # The later ones: the warm-up of every other polyglot figure.
    assert jit_warmup(warm, "node_agent.roundtrip", full) == full.warmup // 2 == 100
    assert jit_warmup(warm, "node_client.roundtrip", full) == 100


def test_a_quick_run_takes_the_meshgo_built_since_its_sources_last_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "meshgo" / "main.go"
    proto = tmp_path / "proto" / "mesh" / "v1" / "broker.proto"
    for f in (source, proto):
        f.parent.mkdir(parents=True)
        f.write_text("")
    ran, made = tmp_path / "run" / "meshgo", tmp_path / "bin" / "meshgo"
    sources = (source.parent, tmp_path / "proto")

    def built(program: Path, at: float) -> None:
        program.parent.mkdir(exist_ok=True)
        program.write_text("")
        os.utime(program, (at, at))

    def edited(f: Path, at: float) -> None:
        os.utime(f, (at, at))

    edited(source, 1_000)
    edited(proto, 1_000)
    assert current_meshgo((ran, made), sources) is None  # nothing built
    built(made, 2_000)
    assert current_meshgo((ran, made), sources) == made  # `make go-client`'s
    built(ran, 3_000)
    assert current_meshgo((ran, made), sources) == ran  # a run's own comes first
    edited(proto, 2_500)  # the contract changed after make go-client, before the run
    assert current_meshgo((made, ran), sources) == ran
    edited(source, 4_000)  # the Go code changed after both
    assert current_meshgo((ran, made), sources) is None

    # A quick run then builds none and says so; the go_agent figure is left out.
    monkeypatch.setattr(harness, "current_meshgo", lambda: None)
    monkeypatch.setattr(harness, "build_meshgo", lambda work: pytest.fail("quick run built it"))
    assert harness.go_agent_program(build=False) is None
    assert "no go_agent figure" in capsys.readouterr().out


def test_the_plot_draws_the_roundtrip_beside_the_relay_whole_with_its_targets() -> None:
    figures = repetition(0.4, 0.8)
    for name, low in (("baseline.relay2", 0.3), ("roundtrip_raw_ends", 0.5), ("roundtrip", 0.7)):
        figures.setdefault(name, {"p50_ms": 2 * low, "p95_ms": 3 * low, "p99_ms": 4 * low})
        figures[name]["quantiles_ms"] = [low + i / 100 for i in range(101)]
    report = {"figures": with_ratios(figures)}

    fig = draw(report)

    whole, every = fig.axes
    assert [line.get_label() for line in whole.get_lines()] == list(SIDE_BY_SIDE)
    assert list(whole.get_lines()[0].get_xdata()) == figures["baseline.relay2"]["quantiles_ms"]
    [targets] = whole.collections  # p50 <= 1.5x and p95 <= 2x the relay's
    assert targets.get_offsets().tolist() == [[1.5 * 0.4, 0.5], [2 * 0.8, 0.95]]
    labels = [t.get_text() for t in every.get_yticklabels()]
    assert labels == [name for name, v in report["figures"].items() if "p50_ms" in v]
    # An earlier report, without the quantiles: the percentiles alone.
    for name in SIDE_BY_SIDE:
        del figures[name]["quantiles_ms"]
    assert len(draw({"figures": with_ratios(figures)}).axes) == 1
