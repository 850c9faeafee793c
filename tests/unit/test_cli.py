"""How `agentmesh send` turns its flags into a message's content and refuses bad JSON, how
a command refuses a module:attribute spec that names nothing, and where the options of how a
process logs may stand."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from mesh.certs import write_dev_certificates
from mesh.cli import _content, build_parser, main, security_config
from mesh.core.auth import Authenticator
from mesh.core.errors import UnauthenticatedError


def args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(**{"content": None, "action": None, "params": None, **flags})


def test_action_and_params_make_the_content() -> None:
    assert _content(args(action="pay", params='{"amount": 450}')) == {
        "action": "pay",
        "parameters": {"amount": 450},
    }


def test_a_priority_or_a_type_is_taken_in_any_case_and_an_unknown_one_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parsed = build_parser().parse_args(
        ["send", "--to", "PaymentAgent", "--priority", "high", "--type", "Request"]
    )
    assert (parsed.priority, parsed.type) == ("HIGH", "REQUEST")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["send", "--to", "PaymentAgent", "--priority", "urgent"])
    assert exited.value.code == 2
    assert "invalid choice: 'URGENT' (choose from 'HIGH', 'MEDIUM', 'LOW')" in (
        capsys.readouterr().err
    )


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


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["agent", "nosuch:thing"], "an agent spec nosuch:thing: No module named 'nosuch'"),
        (["agent", "agents.stocks"], "an agent spec must be module:attribute"),
        (["agent", "agents.stocks:nothing"], "has no attribute 'nothing'"),
        (["broker", "--tools", ":tool_host"], "--tools must be module:attribute"),
    ],
)
def test_a_spec_that_names_nothing_is_a_usage_error(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2  # as argparse ends a command it cannot run
    assert said in capsys.readouterr().err


def test_an_agent_that_cannot_be_made_without_arguments_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", [*sys.path])  # (the file's folder is put on it)
    (tmp_path / "priced.py").write_text(
        "from mesh import Agent\n\n"
        "class Priced(Agent):\n"
        "    agent_id = 'Priced'\n\n"
        "    def __init__(self, rate):\n"
        "        super().__init__()\n"
        "        self.rate = rate\n"
    )
    try:
        with pytest.raises(SystemExit) as exited:
            main(["agent", f"{tmp_path / 'priced.py'}:Priced", "--broker", "127.0.0.1:1"])
    finally:
        sys.modules.pop("priced", None)
    assert exited.value.code == 2
    assert "Priced() cannot be called: missing a required argument: 'rate'; name an agent " in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "args",
    [
        ["up", "--docs", "/nonexistent/docs"],
        ["up", "--data-dir", "/nonexistent/data"],
        ["research", "a question", "--docs", "/nonexistent/docs"],
        ["demo", "--data-dir", "/nonexistent/data"],
    ],
)
def test_a_folder_that_is_none_is_refused_before_anything_starts(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The mesh started, and research found no documents (or each sample agent failed on
    its data) without saying why."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert f"{args[-1]} is not a folder" in capsys.readouterr().err


def test_tools_told_of_a_documents_folder_that_is_none_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AGENTMESH_DOCS_DIR", "/nonexistent/docs")
    with pytest.raises(SystemExit) as exited:
        main(["broker", "--tools", "agents.research:tool_host"])
    assert exited.value.code == 2
    assert "/nonexistent/docs is not a folder of documents" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["broker"], ("WARNING", None, None, 30)),
        (["--log-level", "info", "broker"], ("INFO", None, None, 30)),
        (
            ["broker", "--log-level", "error", "--event-log", "e.jsonl"],
            ("ERROR", None, "e.jsonl", 30),
        ),
        (
            ["--log-level", "info", "up", "--trace-dir", "t", "--event-log-days", "7"],
            ("INFO", "t", None, 7),
        ),
    ],
)
def test_how_a_process_logs_is_taken_before_or_after_the_command(
    argv: list[str], expected: tuple[object, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LOG_LEVEL", "TRACE_DIR", "EVENT_LOG", "EVENT_LOG_DAYS"):
        monkeypatch.delenv(f"AGENTMESH_{name}", raising=False)
    parsed = build_parser().parse_args(argv)
    assert (parsed.log_level, parsed.trace_dir, parsed.event_log, parsed.event_log_days) == expected


def test_a_store_file_that_is_no_database_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback ending in sqlite3.DatabaseError."""
    junk = tmp_path / "queues.db"
    junk.write_text("these are not the queues\n" * 100)
    assert main(["broker", "--port", "0", "--store", f"sqlite:///{junk}"]) == 1
    err = capsys.readouterr().err
    assert (
        f"error: UNAVAILABLE: the SQLite queue store /{junk} cannot be used: file is not a" in err
    )
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["broker", "--port", "99999"], {}, "argument --port: '99999' is not a port (0..65535)"),
        (["up", "--dashboard-port", "-2"], {}, "'-2' is not a port (-1..65535)"),
        (["gateway", "--metrics-port", "x"], {}, "argument --metrics-port: 'x' is not a port"),
        (["broker"], {"AGENTMESH_PORT": "abc"}, "argument --port: 'abc' is not a port"),
        (["gateway", "--max-runs", "0"], {}, "'0' is not a number of runs (1 or more)"),
        (["up"], {"AGENTMESH_GATEWAY_MAX_RUNS": "¹"}, "'¹' is not a number of runs"),
        (["agent", "a:b", "--wait-for-broker", "-1"], {}, "'-1': seconds must be 0 or more"),
        (["agent", "a:b"], {"AGENTMESH_WAIT_FOR_BROKER": "nan"}, "'nan': seconds must be 0"),
        (["agent", "a:b", "--wait-for-broker", "soon"], {}, "'soon' is not a number of seconds"),
        (["broker"], {"AGENTMESH_WAIT_FOR_STORE": "-5"}, "'-5': seconds must be 0 or more"),
    ],
)
def test_a_port_or_a_limit_that_is_none_is_a_usage_error(
    args: list[str],
    env: dict[str, str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A port out of range was a ValueError's traceback; a bad AGENTMESH_PORT one for every
    command, even those that take no port."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    if env:  # (a command without the flag does not read it)
        assert build_parser().parse_args(["agents"]).command == "agents"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"AGENTMESH_KEEPALIVE_SECONDS": "abc"},
            "AGENTMESH_KEEPALIVE_SECONDS must be a positive number of seconds, got 'abc'",
        ),
        (
            {"AGENTMESH_KEEPALIVE_TIMEOUT_SECONDS": "nan"},
            "AGENTMESH_KEEPALIVE_TIMEOUT_SECONDS must be a positive number of seconds",
        ),
        ({"AGENTMESH_EVENT_LOOP": "tokio"}, "AGENTMESH_EVENT_LOOP must be uvloop or asyncio"),
        ({"AGENTMESH_TRACE_DIR": "/proc/none"}, "cannot write traces to /proc/none: [Errno 2]"),
    ],
)
def test_a_setting_of_the_environment_that_is_none_is_a_usage_error(
    env: dict[str, str], said: str, tmp_path: Path
) -> None:
    """Each was a traceback (ValueError as the mesh was imported, FileNotFoundError), or, for
    an event loop nobody has, quietly uvloop; a keepalive of 0 or NaN became 100 ms or a
    traceback."""
    ran = subprocess.run(
        [sys.executable, "-m", "mesh.cli", "broker", "--port", "0"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 2
    assert f"agentmesh: error: {said}" in ran.stderr
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ('{"refund": {"pattern": ', "is not valid JSON: Expecting value: line 1 column 24"),
        ("[1]", "must hold a JSON object of routes by request type"),
        ('{"refund": "HAND_OFF"}', "route 'refund': must be an object"),
        (
            '{"refund": {"pattern": "CONSENSUS", "reason": "r"}}',
            "route 'refund': pattern must be one of GROUP_CHAT, HAND_OFF, COLLABORATIVE_FILTERING,"
            " got 'CONSENSUS'",
        ),
        ('{"refund": {"pattern": "HAND_OFF"}}', "route 'refund': reason must be a non-empty"),
        (
            '{"refund": {"pattern": "HAND_OFF", "reason": "r", "preset": [1]}}',
            "route 'refund': preset must be an object",
        ),
        # A preset its pattern would refuse, each time a caller asked for the route.
        (
            '{"refund": {"pattern": "HAND_OFF", "reason": "r", "preset": {"steps": []}}}',
            "route 'refund': a workflow needs at least one step",
        ),
        (
            '{"hotel": {"pattern": "COLLABORATIVE_FILTERING", "reason": "r", "preset": '
            '{"agent_ids": ["PriceAgent"], "weights": {"price": 1}, "agent_timeout": "60s"}}}',
            "route 'hotel': agent_timeout must be more than 0 and at most 30 s (RT-011's "
            "aggregation timeout), got 60 s",
        ),
        (
            '{"chat": {"pattern": "GROUP_CHAT", "reason": "r", "preset": {"agents": ["A"]}}}',
            "route 'chat': the preset of chat is invalid: Message type "
            '"mesh.v1.RunGroupChatRequest" has no field named "agents"',
        ),
    ],
)
def test_a_routing_table_that_is_none_is_refused_at_start(
    table: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gateway's --routes file with a mistake: said, with the file and the route, before
    the gateway starts (a traceback before; a pattern no route runs was run as another)."""
    routes = tmp_path / "routes.json"
    routes.write_text(table)
    with pytest.raises(SystemExit) as exited:
        main(["gateway", "--routes", str(routes), "--dashboard-port", "-1"])
    assert exited.value.code == 2
    assert f"--routes: {routes}" in (err := capsys.readouterr().err)
    assert said in err


def test_the_shipped_routing_table_is_read() -> None:
    from gateway.patterns.orchestrator import Router

    routes = Router.from_file().routes
    assert routes["stock_recommendation"].pattern.value == "GROUP_CHAT"
    assert routes["refund_request"].preset["failure_agent"] == "NotificationAgent"


@pytest.mark.parametrize(
    ("credentials", "said"),
    [
        ('{"principals": [', "cannot read the credentials file {path}: Expecting value"),
        (
            '{"principals": [{"name": "x", "token": "t", "agents": "A"}]}',
            "principals[0].agents must be a list of agent ids",
        ),
        # Each was a traceback (AttributeError).
        ("[1]", 'the credentials must be a JSON object, with "principals": a list'),
        ('{"principals": {"name": "x"}}', "principals must be a list of objects"),
        ('{"principals": ["payment"]}', "principals[0] must be an object"),
    ],
)
@pytest.mark.parametrize(
    "command", [["broker", "--port", "0"], ["agent", "agents.stocks:IndustryExpertAgent"]]
)
def test_a_credentials_file_that_cannot_be_used_is_said_in_a_line(
    credentials: str, said: str, command: list[str], tmp_path: Path
) -> None:
    """A server given a credentials file it cannot use stops before it starts, saying why
    in one line (a traceback before)."""
    path = tmp_path / "credentials.json"
    path.write_text(credentials)
    with pytest.raises(SystemExit) as exited:
        main([*command, "--credentials-file", str(path)])
    assert str(exited.value.code).startswith(f"security settings: {said.format(path=path)}")


def test_a_token_file_that_cannot_be_used_is_said_in_a_line(tmp_path: Path) -> None:
    """Read as the command starts (an empty token file was sent as "Bearer ", and refused
    by the broker later, UNAUTHENTICATED, with nothing said of the file)."""
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    binary = tmp_path / "binary.token"
    binary.write_bytes(b"\xff\xfe")
    for path, said in (
        (tmp_path / "missing.token", "cannot read {path}: No such file or directory"),
        (empty, "--token-file {path} is empty"),
        (binary, "--token-file {path} is not text"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["agents", "--token-file", str(path)])
        assert str(exited.value.code) == f"security settings: {said.format(path=path)}"


def test_a_token_file_is_what_the_command_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flag, or AGENTMESH_TOKEN_FILE, names the file (read again when it changes), sent
    in place of AGENTMESH_TOKEN."""
    token = tmp_path / "agent.token"
    token.write_text("a-token-of-the-agent-0123\n")
    monkeypatch.setenv("AGENTMESH_TOKEN", "the-environments-token-0123")
    config = security_config(build_parser().parse_args(["agents", "--token-file", str(token)]))
    assert config.token_file == str(token)
    monkeypatch.setenv("AGENTMESH_TOKEN_FILE", str(token))
    config = security_config(build_parser().parse_args(["agents"]))
    assert config.token_file == str(token)


def test_credentials_are_written_then_a_token_rotated_and_the_old_one_retired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "credentials"
    path, tokens = folder / "credentials.json", folder / "tokens"

    def token(name: str) -> str:
        return (tokens / name).read_text().strip()

    principals = ["experts=agents.stocks:stock_experts", "payment=PaymentAgent,HotelAgent"]
    flags = [flag for p in principals for flag in ("--principal", p)]
    assert main(["credentials", str(folder), *flags, "--admin", "gateway"]) == 0
    auth = Authenticator.from_file(path)
    kept = path.read_text()  # (digests alone: no token a reader of the file could send)
    assert not any(token(name) in kept for name in ("experts", "payment", "gateway"))
    experts = auth.authenticate(token("experts"))
    assert (experts.name, experts.agents) == (
        "experts",
        {"FundamentalAnalysisAgent", "IndustryExpertAgent", "TechnicalAnalysisAgent"},
    )
    assert auth.authenticate(token("payment")).agents == {"PaymentAgent", "HotelAgent"}
    assert auth.authenticate(token("gateway")).admin
    assert {p.name: p.stat().st_mode & 0o777 for p in [path, *tokens.iterdir()]} == {
        "credentials.json": 0o600,
        "experts": 0o600,
        "payment": 0o600,
        "gateway": 0o600,
    }

    old = token("payment")
    assert main(["credentials", str(folder), "--rotate", "payment"]) == 0
    new = token("payment")
    auth = Authenticator.from_file(path)
    assert new != old
    assert auth.authenticate(old) == auth.authenticate(new)  # (both, while clients move)
    assert main(["credentials", str(folder), "--retire", "payment"]) == 0
    auth = Authenticator.from_file(path)
    assert auth.authenticate(new).agents == {"PaymentAgent", "HotelAgent"}
    with pytest.raises(UnauthenticatedError):
        auth.authenticate(old)
    assert auth.authenticate(token("experts")).name == "experts"  # (the others untouched)
    said = capsys.readouterr().out
    assert "payment: a new token beside the old (--retire payment once its clients use it)" in said
    assert "payment: older tokens taken out: 1" in said


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ([], "nothing to write: give --principal, --admin, --rotate or --retire"),
        (["--principal", "payment"], "--principal must be NAME=AGENTS, got 'payment'"),
        (["--principal", "gateway=A"], "gateway is a principal already (--rotate gateway"),
        (["--rotate", "nobody"], "--rotate nobody: no principal is so named"),
        (["--retire", "nobody"], "--retire nobody: "),
        (["--rotate", "gateway", "--retire", "gateway"], "--rotate and --retire gateway: one at"),
        (["--principal", "x=nowhere:agents"], "an agent spec nowhere:agents: No module named"),
    ],
)
def test_credentials_it_cannot_write_are_said(
    flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "credentials"
    assert main(["credentials", str(folder), "--admin", "gateway"]) == 0
    before = (folder / "credentials.json").read_text()
    with pytest.raises(SystemExit):
        main(["credentials", str(folder), *flags])
    assert said in capsys.readouterr().err
    assert (folder / "credentials.json").read_text() == before  # (nothing changed)


def test_certificates_that_cannot_be_used_are_said_in_a_line(tmp_path: Path) -> None:
    """A missing file, one that is no PEM, a key that is not the certificate's, a CA that is
    no certificate: each said in a line, naming the flags, before the server starts (before:
    a traceback, or "the port is in use" from gRPC's failure to listen)."""
    certs = write_dev_certificates(tmp_path / "certs", clients=["gateway"])
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    encrypted = tmp_path / "encrypted-key.pem"
    key = serialization.load_pem_private_key(certs["server_key"].read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases = [
        (
            ["--tls-cert", "/nonexistent.pem", "--tls-key", str(certs["server_key"])],
            "cannot read /nonexistent.pem: No such file or directory",
        ),
        (
            ["--tls-cert", str(junk), "--tls-key", str(junk)],
            f"--tls-cert {junk} and --tls-key {junk} are not a PEM certificate and its private key",
        ),
        (
            ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["gateway_key"])],
            "are not a PEM certificate and its private key: the key is not the certificate's",
        ),
        (
            ["--tls-cert", str(certs["server"]), "--tls-key", str(encrypted)],
            "its private key: the key is encrypted (TLS here takes an unencrypted key)",
        ),
        (
            [
                "--tls-cert",
                str(certs["server"]),
                "--tls-key",
                str(certs["server_key"]),
                "--tls-ca",
                str(junk),
            ],
            f"--tls-ca {junk} is not a PEM certificate",
        ),
    ]
    for flags, said in cases:
        with pytest.raises(SystemExit) as exited:
            main(["broker", "--port", "0", *flags])
        assert str(exited.value.code).startswith("security settings: "), flags
        assert said in str(exited.value.code), (flags, exited.value.code)


@pytest.mark.parametrize(
    ("broker", "said"),
    [
        ("", "INVALID_ARGUMENT: an address is required: host:port"),
        ("127.0.0.1:99999", "INVALID_ARGUMENT: 127.0.0.1:99999: a port is from 1 to 65535"),
        ("http://127.0.0.1:50051", "INVALID_ARGUMENT: http://127.0.0.1:50051 is a URL"),
    ],
)
def test_a_broker_address_grpc_cannot_dial_as_meant_is_said_so(
    broker: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: an empty address was UNKNOWN "Failed to create channel" beside gRPC's own
    lines, and port 99999 was dialled as 34463."""
    assert main(["agents", "--broker", broker]) == 1
    assert f"error: {said}" in capsys.readouterr().err
