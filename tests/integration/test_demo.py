"""`agentmesh demo`: every pattern run of the demo ends as it should on the sample agents."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    assert not [line for line in lines if "unexpected:" in line]
    assert (tmp_path / "reports" / "demo-research.md").exists()
    # The one run that fails on purpose: the payment agent refuses order 12347.
    assert [s.name for s in SCENARIOS if s.expect != "COMPLETED"] == ["handoff_failed"]
