"""Where the sample agents read their data: agents/data, or AGENTMESH_DATA_DIR."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"


def data_dir(override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    return Path(os.environ.get("AGENTMESH_DATA_DIR") or DEFAULT_DATA_DIR)


def load(name: str, directory: str | Path | None = None) -> dict[str, Any]:
    """Reads data/<name>; read on every call so that edits show up without a restart."""
    path = data_dir(directory) / name
    try:
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:  # (an edit half done: say where)
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


async def read(name: str, directory: str | Path | None = None) -> dict[str, Any]:
    """:func:`load` off the event loop."""
    return await asyncio.to_thread(load, name, directory)
