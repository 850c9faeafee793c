"""The wheel (what `pip install` and the container image get) holds every file the code reads
at run time: the sample agents' data, the research corpus, the routes, the dashboard."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA_FOLDERS = ("agents/data", "gateway/data", "gateway/dashboard/static")


def test_the_wheel_holds_every_data_file(tmp_path: Path) -> None:
    # Built from a copy of what the image's build stage copies (deploy/Dockerfile).
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("mesh", "agents", "gateway"):
        shutil.copytree(
            ROOT / package,
            source / package,
            ignore=shutil.ignore_patterns("__pycache__", "node_modules", "web"),
        )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("agentmesh-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    wanted = {
        path.relative_to(ROOT).as_posix()
        for folder in DATA_FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
    }
    assert {"agents/data/research/web_snapshot.json", "gateway/data/routes.json"} <= wanted
    assert sorted(wanted - packed) == []
    assert {"mesh/py.typed", "mesh/v1/broker_pb2.pyi"} <= packed
