"""`agentmesh demo`: every pattern run of the demo ends as it should on the sample agents."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import agents
from gateway.demo import SCENARIOS, run_demo
from gateway.embedded import start_embedded


async def test_every_pattern_run_ends_as_the_demo_expects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # (research writes its report to ./research-reports)
    mesh = await start_embedded(reports_dir=tmp_path / "reports")
    lines: list[str] = []
    try:
        assert await run_demo(mesh.gateway.address, out=lines.append) == 0
    finally:
        await mesh.stop()
    summary = lines[lines.index("== Summary") + 2 :][: len(SCENARIOS)]
    for scenario, row in zip(SCENARIOS, summary, strict=True):
        assert row.split()[:1] == scenario.title.split()[:1], row
        assert f" {scenario.expect} " in row, row
    assert not [line for line in lines if "note:" in line]  # each ended as the data says
    # Per pattern: the share of unanimous runs is a group chat's figure, not the others'.
    stats = {
        row.split()[0]: row.split()
        for row in lines
        if row.split()[:1] in (["GROUP_CHAT"], ["HAND_OFF"])
    }
    assert stats["GROUP_CHAT"][5] == "1.00" and stats["HAND_OFF"][5] == "-"
    assert (tmp_path / "reports" / "demo-research.md").exists()
    # The one run that fails on purpose: the payment agent refuses order 12347.
    assert [s.name for s in SCENARIOS if s.expect != "COMPLETED"] == ["handoff_failed"]


async def test_other_data_may_end_a_run_otherwise_which_the_demo_notes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With data of one's own (--data-dir), order 12347's card is fine: its refund completes.
    data = tmp_path / "data"
    shutil.copytree(Path(agents.__file__).parent / "data", data)
    orders = json.loads((data / "orders.json").read_text())
    orders["orders"]["12347"]["card_status"] = "active"
    (data / "orders.json").write_text(json.dumps(orders))
    monkeypatch.chdir(tmp_path)
    mesh = await start_embedded(data_dir=data, reports_dir=tmp_path / "reports")
    lines: list[str] = []
    try:
        assert await run_demo(mesh.gateway.address, out=lines.append) == 0  # not a failure
    finally:
        await mesh.stop()
    notes = [line.strip() for line in lines if "note:" in line]
    assert notes == [
        "note: Hand-off workflow: payment fails (RF-010 10) ended COMPLETED; "
        "on the shipped sample data it ends FAILED"
    ]
