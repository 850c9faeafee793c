"""docs/grpc.md: every `bcurl` command runs, in order, against a real mesh and succeeds."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from datetime import datetime
from pathlib import Path

from gateway.embedded import EmbeddedMesh

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "grpc.md"
BUF = str(Path(sys.executable).parent / "buf")


def command_blocks() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    return [b for b in blocks if "bcurl" in b and "alias bcurl" not in b]


def commands(block: str) -> list[str]:
    """Splits a block into commands: continuation lines and open JSON quotes join lines."""
    out, current = [], ""
    for line in block.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.rstrip().endswith("\\") or current.count("'") % 2:
            continue
        if current.strip():
            out.append(current)
        current = ""
    return out


def test_every_rpc_of_the_contract_is_documented() -> None:
    from mesh.v1 import agent_pb2, broker_pb2, gateway_pb2, memory_pb2, tools_pb2

    text = DOC.read_text()
    missing = []
    for module in (broker_pb2, agent_pb2, gateway_pb2, memory_pb2, tools_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if f"{service.full_name}/{method.name}" not in text:
                    missing.append(f"{service.full_name}/{method.name}")
    assert not missing, f"undocumented RPCs: {missing}"


async def test_every_documented_call_works(embedded: EmbeddedMesh) -> None:
    agents = embedded.describe()["agents"]
    assert isinstance(agents, dict)
    env = {
        **os.environ,
        "BROKER": embedded.broker.address,
        "GATEWAY": embedded.gateway.address,
        "AGENT": agents["PriceAgent"],
    }
    prelude = f'bcurl() {{ {BUF} curl --protocol grpc --http2-prior-knowledge "$@"; }}\n'
    ran = []
    for block in command_blocks():
        for command in commands(block):
            process = await asyncio.create_subprocess_exec(
                "bash",
                "-c",
                prelude + command,
                env=env,
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            async with asyncio.timeout(60):
                out, err = await process.communicate()
            assert process.returncode == 0, f"{command}\n{out.decode()}\n{err.decode()}"
            ran.append((command, out.decode()))
    assert len(ran) >= 25
    by_rpc = {}
    for command, out in ran:
        match = re.search(r"/([\w.]+/\w+)\s*$", command.strip())
        by_rpc[match.group(1) if match else command] = out
    receives = [(c, o) for c, o in ran if c.rstrip().endswith("/ReceiveMessages")]
    [invoiced] = [json.loads(o)["messages"] for c, o in receives if "InvoiceDesk" in c]
    assert [m["content"]["parameters"] for m in invoiced] == [{"amount": 450}]
    [first_receive, *_] = [o for c, o in receives if "PaymentDesk" in c]
    received = json.loads(first_receive)["messages"]
    assert [m["fromAgent"] for m in received] == ["HotelAgent", "CarAgent", "FlightAgent"]
    # A scheduled message: held, deferred until its time.
    [(_, scheduled)] = [
        (c, o) for c, o in ran if c.rstrip().endswith("/ListMessages") and "ReminderDesk" in c
    ]
    [held] = json.loads(scheduled)["messages"]
    assert held["state"] == "QUEUED_STATE_DEFERRED"
    due, until = (datetime.fromisoformat(t) for t in (held["message"]["deliverAt"], held["until"]))
    assert abs((until - due).total_seconds()) < 0.01
    assert json.loads(by_rpc["mesh.v1.BrokerService/CancelMessages"]) == {
        "cancelled": 1,
        "messageIds": ["reminder-2"],
    }
    # The dead letter, requeued, is in the queue again (and no longer a dead letter).
    assert json.loads(by_rpc["mesh.v1.BrokerService/RequeueDeadLetters"]) == {"requeued": 1}
    [(_, back)] = [(c, o) for c, o in ran if '"max_messages": 10' in c]
    assert [m["messageId"] for m in json.loads(back)["messages"]] == [
        "7b0c7e58-0d1e-4a8e-9a53-6f0e3f3b9a01"
    ]
    route_events = [
        json.loads(doc)
        for doc in re.findall(
            r"^\{.*?^\}", by_rpc["mesh.v1.GatewayService/Route"], flags=re.S | re.M
        )
    ]
    assert route_events[-1]["event"]["data"]["error_reason"] == "Payment failed"
    # Left unseen by the session that settled refund-1, refund-2 comes at its first attempt.
    [(_, again)] = [(c, o) for c, o in ran if '"message_ids": ["refund-2"]' in c]
    assert '"messageId": "refund-2"' in again and '"deliveryAttempt": 1' in again
    # The request given up: its delivery, its error, then the withdrawal of the delivery.
    [(_, withdrawn)] = [(c, o) for c, o in ran if '"withdrawals": true' in c]
    delivered = withdrawn.index('"delivery": {')
    failed = withdrawn.index('"seq": "2"')
    taken_back = withdrawn.index('"withdrawn": {')
    assert delivered < failed < taken_back, withdrawn
    assert '"agentId": "PaymentDesk"' in withdrawn[taken_back:]
    [(_, session)] = [(c, o) for c, o in ran if '"broadcast": {' in c]
    assert '"seq": "3"' in session and '"broadcasted": {' in session
    assert '"recipients": [\n' in session and '"PaymentAgent"' in session
    [dead] = json.loads(by_rpc["mesh.v1.BrokerService/ListDeadLetters"])["deadLetters"]
    assert dead["reason"] == "PaymentDesk does not handle action refund"
    assert dead["deliveryAttempts"] == 2
    deleted = json.loads(by_rpc["mesh.v1.MemoryService/DeleteState"])["entry"]
    assert deleted["value"] == {"left": 80} and deleted["version"] == "2"
    assert deleted["updatedBy"] == "buyer"  # written under the buyer's lock
    # The workflow handed off above is listed under workflow/, with the agent that has it.
    listed = json.loads(by_rpc["mesh.v1.MemoryService/ListState"])["entries"]
    assert [e["key"] for e in listed] == ["workflow/wf_refund_123"], listed
    assert listed[0]["value"]["current_agent"] == "PaymentDesk", listed
    [(_, watched)] = [(c, o) for c, o in ran if '"send_initial": true' in c]
    kinds = re.findall(r'"kind": "STATE_CHANGE_KIND_(\w+)"', watched)
    assert kinds == ["CURRENT", "SYNCED"] and '"key": "workflow/wf_refund_123"' in watched
    feedback = json.loads(by_rpc["mesh.v1.GatewayService/RecordFeedback"])
    assert feedback["pattern"] == "PATTERN_GROUP_CHAT"
    assert feedback["stats"]["rated"] == "1" and feedback["stats"]["accuracy"] == 1
    stats = json.loads(by_rpc["mesh.v1.GatewayService/GetPatternStats"])["patterns"]
    [group_chats] = [p for p in stats if p["pattern"] == "PATTERN_GROUP_CHAT"]
    assert group_chats["satisfied"] == "1"
    assert '"decision": "ACCEPT"' in by_rpc["mesh.v1.GatewayService/RunConsensus"]
    assert "EVENT_KIND_REPORT" in by_rpc["mesh.v1.GatewayService/RunResearch"]
    assert '"tool": "web_search"' not in by_rpc["mesh.v1.ToolService/ListTools"]
    assert '"name": "web_search"' in by_rpc["mesh.v1.ToolService/ListTools"]
