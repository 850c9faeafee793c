"""How `agentmesh send` turns its flags into a message's content, and refuses bad JSON."""

from __future__ import annotations

import argparse

import pytest

from mesh.cli import _content


def args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(**{"content": None, "action": None, "params": None, **flags})


def test_action_and_params_make_the_content() -> None:
    assert _content(args(action="pay", params='{"amount": 450}')) == {
        "action": "pay",
        "parameters": {"amount": 450},
    }


def test_params_without_an_action_reach_the_broker_to_be_refused_there() -> None:
    assert _content(args(params='{"amount": 1}')) == {"parameters": {"amount": 1}}


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ({"params": "{oops"}, "--params is not valid JSON"),
        ({"params": "[1]"}, "--params must be a JSON object"),
        ({"content": "[1]"}, "--content must be a JSON object"),
    ],
)
def test_bad_json_is_refused_before_anything_is_sent(flags: dict, error: str) -> None:
    with pytest.raises(SystemExit, match=error):
        _content(args(**flags))
