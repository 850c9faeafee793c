"""The mesh across OS processes: broker and agents started with the `agentmesh` command."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mesh import BrokerUnavailableError, ChangeKind, MessageType, connect
from mesh.client import NO_RETRY
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching
from tests.helpers.processes import (
    BROKER_READY,
    SCRIPT,
    Proc,
    free_port,
    free_ports_in_a_row,
    instances_become,
    request_once_back,
    signal_process,
    start,
    stop,
    wait_killed,
)

pytestmark = pytest.mark.processes
ROOT = Path(__file__).resolve().parents[2]

CLI_AT_A_TERMINAL = (
    sys.executable,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler);"
    " runpy.run_module('mesh.cli', run_name='__main__', alter_sys=True)",
)
"""`python -m mesh.cli` as started from a terminal, where Ctrl-C interrupts it: a process
started in the background of a non-interactive shell (as a CI runner may start the tests)
inherits SIGINT ignored, and Python leaves it so."""


@pytest.fixture
async def broker_proc() -> AsyncIterator[Proc]:
    proc = await start("broker", "--port", "0", ready=r"listening on (\S+?)[,\s]")
    try:
        yield proc
    finally:
        await stop(proc)


async def test_request_and_handoff_cross_three_processes(broker_proc: Proc) -> None:
    payment = await start(
        "agent",
        "tests.helpers.process_agents:Payment",
        "--broker",
        broker_proc.address,
        ready=r"serving on (\S+),",
    )
    seller = await start(
        "agent",
        "tests.helpers.process_agents:Seller",
        "--broker",
        broker_proc.address,
        ready=r"serving on (\S+),",
    )
    try:
        async with connect(broker_proc.address, agent_id="CustomerAgent") as customer:
            await customer.register()
            agents = {a.agent_id: a for a in await customer.list_agents()}
            assert agents["PaymentAgent"].address == payment.address
            assert agents["PaymentAgent"].agent_types == ("payment",)

            response = await customer.request(
                "PaymentAgent",
                {"action": "process_payment", "parameters": {"amount": 50}},
                timeout=10,
            )
            assert response.message_type is MessageType.RESPONSE
            assert response.content["status"] == "PAID"
            assert response.content["pid"] == payment.process.pid

            await customer.handoff(
                "SellerAgent",
                "Approve refund for order 12345",
                context={"order_id": "12345", "report_to": "CustomerAgent"},
                previous_result={"eligible": True},
                workflow_id="wf_refund_123",
                step_number=1,
            )
            async with customer.subscribe() as inbox:
                async with asyncio.timeout(10):
                    async for received in inbox:
                        await received.ack()
                        message = received.message
                        break
            assert message.message_type is MessageType.HANDOFF
            assert message.from_agent == "SellerAgent"
            handoff = message.handoff
            assert handoff.workflow_id == "wf_refund_123" and handoff.step_number == 2
            assert handoff.previous_result["seller_pid"] == seller.process.pid
            assert handoff.previous_result["received"] == {"eligible": True}
            assert handoff.context["order_id"] == "12345"
    finally:
        assert await stop(payment) == 0
        assert await stop(seller) == 0
    async with connect(broker_proc.address) as client:
        # Graceful shutdown deregistered both agents.
        remaining = {a.agent_id for a in await client.list_agents()}
        assert remaining == {"CustomerAgent"}


async def payment_agent(broker: Proc) -> Proc:
    """A process of PaymentAgent (tests/helpers/process_agents.py) serving through ``broker``."""
    return await start(
        "agent",
        "tests.helpers.process_agents:Payment",
        "--broker",
        broker.address,
        ready=r"serving on (\S+),",
    )


async def test_a_rolling_update_of_an_agent_loses_no_request(broker_proc: Proc) -> None:
    """The shape of a Kubernetes rolling update: a second process of PaymentAgent starts, the
    first gets SIGTERM, while requests keep coming. Every one is answered (none NOT_FOUND,
    none timed out), by the old process and then by the new, and the agent stays registered
    with the new one as its instance."""

    old = await payment_agent(broker_proc)
    new: Proc | None = None
    async with connect(broker_proc.address, agent_id="Checkout") as client:
        await client.register()
        answered: list[int] = []
        done = asyncio.Event()

        async def keep_asking() -> None:
            while not done.is_set():
                answer = await client.request(
                    "PaymentAgent",
                    {"action": "process_payment", "parameters": {"amount": 5}},
                    timeout=10,
                )
                answered.append(answer.content["pid"])
                await asyncio.sleep(0.01)

        asking = asyncio.create_task(keep_asking())
        try:
            new = await payment_agent(broker_proc)

            async def agents(*flags: str) -> str:
                listed = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "mesh.cli", "agents", "--broker", broker_proc.address,
                    *flags, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                return (await listed.communicate())[0].decode()

            [payment] = [
                a for a in json.loads(await agents("--json")) if a["agent_id"] == "PaymentAgent"
            ]
            assert payment["instances"] == [old.address, new.address]
            assert payment["address"] == new.address
            assert f"{new.address} (+1 more)" in await agents()
            assert await stop(old) == 0
            count = len(answered)
            while len(answered) < count + 20:
                await asyncio.sleep(0.01)
                assert not asking.done(), asking.exception()
            done.set()
            await asking  # every request answered, none refused
            [info] = [a for a in await client.list_agents() if a.agent_id == "PaymentAgent"]
            assert info.instances == (new.address,)
        finally:
            done.set()
            asking.cancel()
            await stop(old)  # (at once when it has already stopped)
            if new is not None:
                assert await stop(new) == 0
        assert answered[0] == old.process.pid and answered[-1] == new.process.pid
        assert "PaymentAgent" not in {a.agent_id for a in await client.list_agents()}


async def test_an_agent_process_that_dies_is_taken_off_its_agents_instances(
    broker_proc: Proc,
) -> None:
    """Two processes serve PaymentAgent; each is killed (SIGKILL: no deregistration). Each
    is taken off the agent's instances as its stream to the broker breaks; with the last gone
    the agent stays registered with none, and what is sent to it waits in its queue until a
    new process serves it."""

    first, second = await payment_agent(broker_proc), await payment_agent(broker_proc)
    third: Proc | None = None
    async with connect(broker_proc.address, agent_id="Checkout", retry=NO_RETRY) as client:
        await client.register()

        try:
            await instances_become(client, "PaymentAgent", (first.address, second.address))
            await wait_killed(second)
            info = await instances_become(client, "PaymentAgent", (first.address,))
            assert info.address == first.address
            await wait_killed(first)
            info = await instances_become(client, "PaymentAgent", ())
            assert info.address == "" and info.agent_types == ("payment",)  # still registered
            assert info.lost_at is not None
            listed = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mesh.cli", "agents", "--broker", broker_proc.address,
                cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            table = (await listed.communicate())[0].decode()
            when = info.lost_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
            [row] = [line for line in table.splitlines() if line.startswith("PaymentAgent ")]
            assert f"- (none since {when}Z)" in row

            sent = await client.send(
                "PaymentAgent", {"action": "process_payment", "parameters": {"amount": 7}}
            )
            stats = (await client.queue_stats("PaymentAgent")).for_agent("PaymentAgent")
            assert stats is not None and stats.depth == 1

            third = await payment_agent(broker_proc)
            info = await instances_become(client, "PaymentAgent", (third.address,))
            assert info.lost_at is None
            async with asyncio.timeout(10):
                while not (answers := await client.receive()):  # noqa: ASYNC110 - polls
                    await asyncio.sleep(0.02)
            [answer] = answers
            assert answer.correlation_id == sent.message_id
            assert answer.content["pid"] == third.process.pid
        finally:
            for proc in (first, second, third):
                if proc is not None:
                    proc.kill()
    log = "".join(broker_proc.output)
    for proc in (second, first):
        assert f"the instance at {proc.address} is gone" in log


SHOP = """
from mesh import Agent, on
{imports}

class Shop(Agent):
    agent_id = "{agent_id}"

    @on("price")
    async def price(self, message, ctx):
        return {{"price": {price}}}
"""


async def test_the_agentmesh_script_serves_an_agent_from_the_working_directory_or_a_file(
    broker_proc: Proc, tmp_path: Path
) -> None:
    """`agentmesh agent shop:Shop` run (by the installed script, as a user's shell runs it)
    where shop.py is, as `python -m` and uvicorn find a module; `agentmesh agent
    path/to/file.py:Attr` from anywhere, the file's own imports found beside it."""
    (tmp_path / "shop.py").write_text(SHOP.format(imports="", agent_id="ShopAgent", price=450))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "tariff.py").write_text("PRICE = 120\n")
    (tmp_path / "elsewhere" / "kiosk.py").write_text(
        SHOP.format(imports="from tariff import PRICE", agent_id="KioskAgent", price="PRICE")
    )
    broker = ("--broker", broker_proc.address)
    ready = r"serving on (\S+)"
    shop = await start("agent", "shop:Shop", *broker, ready=ready, cwd=tmp_path, program=SCRIPT)
    kiosk = None
    try:
        kiosk = await start(
            "agent", "elsewhere/kiosk.py:Shop", *broker, ready=ready, cwd=tmp_path, program=SCRIPT
        )
        async with connect(broker_proc.address, agent_id="Buyer") as client:
            answer = await client.request("ShopAgent", {"action": "price"}, timeout=10)
            assert answer.content["price"] == 450
            answer = await client.request("KioskAgent", {"action": "price"}, timeout=10)
            assert answer.content["price"] == 120
    finally:
        for proc in (kiosk, shop):
            if proc is not None:
                assert await stop(proc) == 0
    for spec, said in (
        ("missing.py:Shop", "an agent spec missing.py:Shop: no file missing.py"),
        ("shop:Nope", "an agent spec shop:Nope: module 'shop' has no attribute 'Nope'"),
    ):
        process = await asyncio.create_subprocess_exec(
            *SCRIPT,
            "agent",
            spec,
            *broker,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        assert process.returncode == 2 and said in out.decode(), out.decode()


async def run_script(path: Path, text: str, *args: str) -> asyncio.subprocess.Process:
    """A user's own Python script, written to ``path`` and run with ``args`` (output piped)."""
    await asyncio.to_thread(path.write_text, text)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(path),
        *args,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


AGENT_SCRIPT = """
import sys
from mesh import Agent, on, run_agents


class Payment(Agent):
    agent_id = "ScriptPayment"

    @on("process_payment")
    async def pay(self, message, ctx):
        return {"status": "PAID", "amount": message.parameters["amount"]}


if __name__ == "__main__":
    run_agents(Payment(), broker=sys.argv[1])
    print("stopped")
"""


async def test_a_script_that_is_an_agent_serves_until_sigterm_then_leaves_the_mesh(
    broker_proc: Proc, tmp_path: Path
) -> None:
    """`run_agents(Payment(), broker=...)` is a script's whole main: it serves until a
    signal, then stops gracefully (deregistered) and returns."""
    process = await run_script(tmp_path / "pay.py", AGENT_SCRIPT, broker_proc.address)
    try:
        async with connect(broker_proc.address, agent_id="Cashier", retry=NO_RETRY) as client:
            answer = await request_once_back(
                client,
                "ScriptPayment",
                {"action": "process_payment", "parameters": {"amount": 450}},
            )
            assert answer.content["status"] == "PAID" and answer.content["amount"] == 450
            signal_process(process, signal.SIGTERM)
            out, _ = await asyncio.wait_for(process.communicate(), 30)
            assert process.returncode == 0 and out.decode().splitlines()[-1] == "stopped", out
            listed = [a.agent_id for a in await client.list_agents()]
            assert "ScriptPayment" not in listed, listed
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


MODULE_LEVEL_CLIENT = """
import asyncio, sys
from mesh import connect

client = connect(sys.argv[1], agent_id="Notes")  # made before any event loop runs


async def main():
    await client.register()
    await client.send("Notes", {"action": "remember", "parameters": {"n": 1}})
    print([m.parameters["n"] for m in await client.receive()])


asyncio.run(main())
try:
    asyncio.run(main())  # a second loop: the client's connection is the first one's
except RuntimeError as error:
    print(error)
"""


async def test_a_client_made_before_asyncio_run_works_in_the_loop_that_runs(
    broker_proc: Proc, tmp_path: Path
) -> None:
    """A client made at a module's top, then used in asyncio.run(main()): a grpc.aio
    channel made outside any loop is tied to another one ("attached to a different loop").
    Used again in a second asyncio.run(), it says what to do (gRPC said "Event loop is
    closed")."""
    process = await run_script(tmp_path / "notes.py", MODULE_LEVEL_CLIENT, broker_proc.address)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    lines = out.decode().splitlines()
    assert process.returncode == 0 and lines[-2] == "[1]", out.decode()
    assert lines[-1].startswith(
        "this MeshClient was first used in another event loop, and its connection belongs to "
        "that one: make a client in each event loop"
    ), out.decode()


async def test_cli_send_receive_and_agents(broker_proc: Proc) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTMESH_BROKER": broker_proc.address}

    async def cli(*args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mesh.cli",
            *args,
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        return process.returncode or 0, out.decode()

    async with connect(broker_proc.address) as client:
        await client.register("PaymentAgent", agent_types=["payment"])
    code, out = await cli(
        "send",
        "--to",
        "PaymentAgent",
        "--action",
        "process_payment",
        "--params",
        '{"amount": 450}',
        "--priority",
        "HIGH",
    )
    assert code == 0 and out.startswith("sent ")
    code, out = await cli("agents")
    assert code == 0
    assert re.search(r"PaymentAgent\s+payment\s+-\s+1\s+0", out), out
    code, out = await cli("receive", "--agent", "PaymentAgent")
    assert code == 0
    assert "HIGH   REQUEST   cli -> PaymentAgent" in out
    assert '"parameters":{"amount":450}' in out
    code, out = await cli("receive", "PaymentAgent")  # the agent named as in `state KEY`
    assert code == 0 and out.strip() == "no messages for PaymentAgent"
    code, out = await cli("receive")
    assert code == 2 and "receive: name one agent (AGENT or --agent AGENT)" in out
    code, out = await cli("send", "--to", "PaymentAgent")
    assert code == 1
    assert "INVALID_ARGUMENT: content is required" in out
    code, out = await cli("send", "--to", "Nobody", "--action", "x")
    assert code == 1 and "NOT_FOUND: agent Nobody is not registered" in out

    # The shared state: write (compare-and-set), read, refuse a stale write, delete.
    code, out = await cli("state", "budget", '{"left": 100}', "--expect-version", "0")
    assert code == 0 and re.search(r"^budget  version 1  by cli  at \S+  \{\"left\":100\}$", out), (
        out
    )
    code, out = await cli("state", "budget", "--json")
    assert code == 0 and json.loads(out)["value"] == {"left": 100}
    code, out = await cli("state", "budget", '{"left": 0}', "--expect-version", "0")
    assert code == 1 and "ABORTED: 'budget' is at version 1, not 0" in out, out
    code, out = await cli("state", "budget", "{left: 0}")
    assert code == 1 and "INVALID_ARGUMENT: value is not JSON" in out, out
    assert "quoted" not in out  # (an object misspelt: no hint of text)
    code, out = await cli("state", "plan", "v2")  # a text, unquoted
    assert code == 1 and out.rstrip().endswith("""(a text is quoted in JSON: '"v2"')"""), out
    code, out = await cli("state", "budget", "--delete")
    assert code == 0 and out.strip() == "deleted budget at version 1"
    code, out = await cli("state", "budget")
    assert code == 1 and "no shared state named 'budget'" in out
    code, out = await cli("state", "hold", '"printer"', "--ttl", "60", "--json")
    written = json.loads(out)
    lapses = datetime.fromisoformat(written["expires_at"]) - datetime.now(UTC)
    assert code == 0 and timedelta(seconds=55) < lapses <= timedelta(seconds=60), out
    code, out = await cli("state", "hold")
    assert code == 0 and re.search(
        r"^hold  version 1  by cli  at \S+  until \S+  \"printer\"$", out
    )
    code, out = await cli("state", "hold", "--ttl", "5")
    assert code == 1 and "--ttl goes with a VALUE to write" in out, out
    code, out = await cli("state", "hold", "1", "--ttl", "0")
    assert code == 1 and "INVALID_ARGUMENT: ttl must be above 0" in out, out
    # Listed by prefix, in key order: every page walked (150 entries, pages of 100).
    async with connect(broker_proc.address, agent_id="Tracker") as client:
        for n in (2, 0, 1, *range(3, 150)):
            await client.put_state(f"parcel/{n:03d}", {"n": n})
    code, out = await cli("state", "--prefix", "parcel/")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 150, out[-500:]
    assert re.match(r"^parcel/000  version 1  by Tracker  at \S+  \{\"n\":0\}$", lines[0])
    assert [line.split()[0] for line in lines] == [f"parcel/{n:03d}" for n in range(150)]
    code, out = await cli("state", "--prefix", "", "--json")
    listed = json.loads(out)
    assert code == 0 and [e["key"] for e in listed] == ["hold"] + [
        f"parcel/{n:03d}" for n in range(150)
    ]
    assert listed[1]["value"] == {"n": 0} and listed[1]["updated_by"] == "Tracker"
    # A reader gone before the listing is written (`agentmesh state --prefix "" | head -0`)
    # ends it quietly, as a shell's tools end.
    reader, writer = os.pipe()
    os.close(reader)
    listing = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "mesh.cli", "state", "--prefix", ""),
        cwd=ROOT,
        env=env,
        stdout=writer,
        stderr=asyncio.subprocess.PIPE,
    )
    os.close(writer)
    _, err = await listing.communicate()
    assert listing.returncode == 141 and err == b"", err
    # Watched: the entries there are, then each change as it is made, until Ctrl-C.
    watching = await asyncio.create_subprocess_exec(
        *CLI_AT_A_TERMINAL,
        "state",
        "--prefix",
        "parcel/14",
        "--watch",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert watching.stdout is not None and watching.stderr is not None
    first = [(await watching.stdout.readline()).decode() for _ in range(10)]
    assert [line.split()[:2] for line in first] == [
        ["current", f"parcel/{n}"] for n in range(140, 150)
    ], first
    assert b"watching 'parcel/14' (Ctrl-C to stop)" in await watching.stderr.readline()
    async with connect(broker_proc.address, agent_id="Tracker") as client:
        await client.put_state("parcel/149", {"out": True, "n": 149})
        await client.put_state("parcel/150", {"n": 150})  # not under parcel/14
        await client.delete_state("parcel/140")
    then = [(await watching.stdout.readline()).decode() for _ in range(2)]
    assert re.match(
        r'^put     parcel/149  version 2  by Tracker  at \S+  \{"n":149,"out":true\}$', then[0]
    ), then
    assert then[1].startswith("delete  parcel/140  version 1"), then
    watching.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(watching.wait(), 10) == 130
    as_json = await asyncio.create_subprocess_exec(
        *CLI_AT_A_TERMINAL,
        "state",
        "--prefix",
        "parcel/149",
        "--watch",
        "--json",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert as_json.stdout is not None
    line = json.loads(await asyncio.wait_for(as_json.stdout.readline(), 10))
    assert line["kind"] == "current" and line["entry"]["value"] == {"n": 149, "out": True}
    assert line["entry"]["key"] == "parcel/149" and line["entry"]["version"] == 2
    as_json.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(as_json.wait(), 10) == 130
    # The hand-off workflows, from their status: the latest hand-off first.
    async with connect(broker_proc.address, agent_id="CliSeller") as client:
        await client.register("CliPayment")
        await client.handoff("CliPayment", "Refund 50", workflow_id="wf_cli_1", step_number=2)
        await client.handoff("CliPayment", "Refund 70", workflow_id="wf_cli_2", step_number=3)
        failed = await client.get_state("workflow/wf_cli_2")
        assert failed is not None
        await client.put_state(
            "workflow/wf_cli_2",
            {**failed.value, "status": "FAILED", "failed_at_step": 2, "error_reason": "declined"},
        )
    code, out = await cli("workflows")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == [
        "WORKFLOW", "STATUS", "STEP", "AGENT", "FROM", "HANDED", "OFF", "TASK"
    ], out  # fmt: skip
    assert re.match(r"^wf_cli_2 +FAILED at step 3: declined +3 +CliPayment +CliSeller ", lines[1])
    assert re.match(r"^wf_cli_1 +IN_PROGRESS +2 +CliPayment +CliSeller +\S+ +Refund 50$", lines[2])
    assert lines[-1] == "2 workflows"
    code, out = await cli("workflows", "--status", "IN_PROGRESS", "--json")
    assert code == 0 and [w["workflow_id"] for w in json.loads(out)] == ["wf_cli_1"]
    async with connect(broker_proc.address) as client:
        await client.deregister("CliPayment")  # (the broadcasts below reach the others)
    code, out = await cli("state", "parcel/1", "--watch")
    assert code == 1 and "--watch goes with --prefix" in out, out
    code, out = await cli("state", "--prefix", "nothing/")
    assert code == 0 and out.strip() == "no shared state entries under 'nothing/'"
    code, out = await cli("state", "parcel/001", "--prefix", "parcel/")
    assert code == 1 and "--prefix lists entries: give no KEY" in out, out
    code, out = await cli("state")
    assert code == 1 and "give a KEY, or --prefix to list entries" in out, out

    # An instance of an agent gone without a word is taken off by its address; the agent by id.
    async with connect(broker_proc.address) as client:
        for host in ("10.0.0.1", "10.0.0.2"):
            await client.register("TwinDesk", address=f"{host}:7000")
    code, out = await cli("deregister", "TwinDesk", "--address", "10.0.0.1:7000")
    assert code == 0 and out.strip() == (
        "the instance at 10.0.0.1:7000 of TwinDesk left; serving it still: 10.0.0.2:7000"
    ), out
    code, out = await cli("deregister", "TwinDesk")
    assert code == 0 and out.strip() == "deregistered TwinDesk", out
    code, out = await cli("deregister", "TwinDesk")
    assert code == 1 and "NOT_FOUND: agent TwinDesk is not registered" in out, out

    # A broadcast (RF-009 scenario 3) names who got it; --types narrows it (scenario 17).
    async with connect(broker_proc.address) as client:
        await client.register("HotelAgent", agent_types=["hotel"])
    code, out = await cli(
        "send", "--to", "broadcast", "--content", '{"alert": "System maintenance in 10 minutes"}'
    )
    assert code == 0 and re.fullmatch(
        r"broadcast \S+ to 2 agents: (HotelAgent, PaymentAgent|PaymentAgent, HotelAgent)",
        out.strip(),
    ), out
    code, out = await cli("send", "--to", "broadcast", "--types", "payment", "--action", "x")
    assert code == 0 and out.strip().endswith("to 1 agents: PaymentAgent"), out
    code, out = await cli("send", "--to", "PaymentAgent", "--types", "payment", "--action", "x")
    assert code == 2 and "--types is for a broadcast" in out, out
    async with connect(broker_proc.address) as client:
        [alert, _] = await client.receive("PaymentAgent")
        assert alert.message_type is MessageType.BROADCAST
        assert alert.content == {"alert": "System maintenance in 10 minutes"}
        await client.deregister("HotelAgent")

    # Dead letters: shown by `stats`, put back by `requeue` (all, or those named).
    async with connect(broker_proc.address, agent_id="PaymentAgent") as client:
        for n in range(2):
            await client.send("PaymentAgent", {"action": "refund", "n": n})
        async with client.subscribe("PaymentAgent") as inbox:
            for _ in range(2):
                delivery = await asyncio.wait_for(anext(aiter(inbox)), 5)
                await delivery.reject("no refund handler yet")
        first = (await client.dead_letters("PaymentAgent"))[0].message.message_id
    code, out = await cli("stats", "--agent", "PaymentAgent")
    assert code == 0 and out.count("no refund handler yet") == 2, out
    header, row = out.splitlines()[:2]
    assert header.split("  ")[0].strip() == "AGENT" and row.split()[0] == "PaymentAgent"
    # Each count ends under the end of its heading.
    for heading, count in (("DEPTH", "0"), ("DEAD", "2")):
        end = header.index(heading) + len(heading)
        assert row[end - len(count) : end] == count, (header, row)
    totals = next(line for line in out.splitlines() if line.startswith("totals: "))
    assert "dead_lettered_count=2" in totals and "dead_lettered_count=2.0" not in totals
    code, out = await cli("stats", "--agent", "PaymentAgent", "--json")
    report = json.loads(out)
    assert code == 0 and [a["dead_letters"] for a in report["agents"]] == [2], out
    assert [d["reason"] for d in report["dead_letters"]] == ["no refund handler yet"] * 2
    code, out = await cli("requeue", "PaymentAgent", first)
    assert code == 0 and out.strip() == "1 dead letters of PaymentAgent requeued", out
    code, out = await cli("requeue", "PaymentAgent")
    assert code == 0 and out.strip() == "1 dead letters of PaymentAgent requeued", out
    # What the queue holds, in delivery order, left there.
    code, out = await cli("queue", "PaymentAgent")
    assert code == 0, out
    header, *rows, summary = out.strip().splitlines()
    assert header.split() == [
        "MESSAGE",
        "STATE",
        "PRIORITY",
        "TYPE",
        "FROM",
        "ACTION",
        "ATTEMPTS",
        "AGE",
        "EXPIRES",
        "IN",
        "UNTIL",
    ]
    assert [row.split()[1:7] for row in rows] == [
        ["WAITING", "MEDIUM", "REQUEST", "PaymentAgent", "refund", "0"]
    ] * 2
    assert rows[0].split()[0] == first  # (requeued first: back in its place)
    age, expires_in, until = rows[0].split()[7:10]  # (its ttl of an hour from the requeue)
    assert re.fullmatch(r"\d+\.\ds", age) and re.fullmatch(r"59m[0-5]\ds", expires_in)
    assert until == "-"  # (waiting: no lease or delay to end)
    assert summary == "PaymentAgent: 2 waiting, 0 in flight, 0 deferred"
    code, out = await cli("queue", "PaymentAgent", "--json")
    listed = json.loads(out)
    assert code == 0 and [q["message"]["content"]["n"] for q in listed] == [0, 1], out
    assert [(q["state"], q["until"]) for q in listed] == [("WAITING", None)] * 2
    code, out = await cli("queue", "Nobody")
    assert code == 1 and "NOT_FOUND: agent Nobody is not registered" in out, out
    # A scheduled message (--delay): held, deferred, until it is due.
    code, out = await cli("send", "--to", "PaymentAgent", "--action", "remind", "--delay", "60")
    assert code == 0 and re.fullmatch(
        r"sent \S+ \(due \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00\)", out.strip()
    ), out
    code, out = await cli("queue", "PaymentAgent")
    *_, deferred, summary = out.strip().splitlines()
    assert deferred.split()[1:6] == ["DEFERRED", "MEDIUM", "REQUEST", "cli", "remind"]
    assert summary == "PaymentAgent: 2 waiting, 0 in flight, 1 deferred", out
    code, out = await cli("stats", "--agent", "PaymentAgent")
    header, row = out.splitlines()[:2]
    for heading, count in (("DEPTH", "2"), ("IN FLIGHT", "0"), ("DEFERRED", "1")):
        end = header.index(heading) + len(heading)
        assert row[end - len(count) : end] == count, (header, row)
    # Taken back by its sender before it is due (`cancel`).
    scheduled = deferred.split()[0]
    code, out = await cli("cancel", "PaymentAgent", scheduled, "nope")
    assert code == 0, out
    assert out.splitlines() == [
        "1 of 2 messages from cli to PaymentAgent cancelled",
        f"cancelled {scheduled}",
    ]
    code, out = await cli("queue", "PaymentAgent")
    assert out.strip().splitlines()[-1] == "PaymentAgent: 2 waiting, 0 in flight, 0 deferred"
    async with connect(broker_proc.address) as client:
        assert [m.content["n"] for m in await client.receive("PaymentAgent")] == [0, 1]
        assert await client.dead_letters("PaymentAgent") == []

    # The shared memory pool: list by tag, count, delete (a delete must name what it takes).
    async with connect(broker_proc.address, agent_id="reviewer_1") as client:
        await client.write_insight("approve", tags=["vote", "p1"], segment="votes", ttl=3600)
        await client.write_insight("modify", tags=["vote", "p2"], segment="votes")
    code, out = await cli("insights", "--tag", "vote", "--tag", "p1")
    assert code == 0, out
    [line, summary] = out.strip().splitlines()
    assert re.fullmatch(
        r'insight_\d+  votes  by reviewer_1  \[vote,p1\]  0\.5  until \S+  "approve"', line
    ), line
    assert summary == "1 insights"
    code, out = await cli("insights", "--stats")
    assert code == 0 and json.loads(out)["segment_distribution"] == {"votes": 2}
    code, out = await cli("insights", "--delete")
    assert code == 1 and "INVALID_ARGUMENT: name the insights to delete" in out, out
    code, out = await cli("insights", "--delete", "--segment", "votes", "--tag", "p2")
    assert code == 0 and out.strip() == "deleted 1 insights"
    code, out = await cli("insights", "--json")
    assert [i["content"] for i in json.loads(out)] == ["approve"]

    # --request prints the answer; an agent that fails makes the exit code 1.
    from mesh import AgentContext, Message, agent, serve

    @agent("Quoter")
    async def quoter(message: Message, ctx: AgentContext) -> dict[str, object]:
        if message.action == "fail":
            raise RuntimeError("no quote today")
        return {"quote": 42}

    served = await serve(quoter, broker_proc.address)
    try:
        code, out = await cli("send", "--to", "Quoter", "--action", "quote", "--request")
        assert code == 0 and "RESPONSE" in out and '"quote":42' in out, out
        code, out = await cli("send", "--to", "Quoter", "--action", "fail", "--request")
        assert code == 1 and "error: ABORTED: no quote today" in out, out
    finally:
        await served.stop(1.0)


async def test_broker_takes_its_limits_from_the_environment() -> None:
    os.environ["AGENTMESH_MAX_MESSAGES_PER_AGENT"] = "2"
    try:
        proc = await start("broker", "--port", "0", ready=r"listening on (\S+?)[,\s]")
    finally:
        del os.environ["AGENTMESH_MAX_MESSAGES_PER_AGENT"]
    try:
        from mesh import MessageQueueFullError
        from mesh.client import NO_RETRY

        async with connect(proc.address, agent_id="sender", retry=NO_RETRY) as client:
            await client.register("Small")
            await client.send("Small", {"action": "one"})
            await client.send("Small", {"action": "two"})
            with pytest.raises(MessageQueueFullError, match="Small queue full"):
                await client.send("Small", {"action": "three"})
    finally:
        assert await stop(proc) == 0


def events_in(output: list[str]) -> list[dict[str, object]]:
    import json

    return [json.loads(line) for line in output if line.startswith("{")]


async def hand_off_and_broadcast(address: str) -> None:
    async with connect(address, agent_id="CustomerAgent") as client:
        await client.register("SellerAgent", agent_types=["booking"])
        await client.register("PaymentAgent", agent_types=["payment"])
        await client.handoff(
            "SellerAgent",
            "Approve refund",
            context={"order_id": "12345"},
            constraints={"refund_method": "original_payment"},
            workflow_id="wf_refund_123",
            step_number=2,
        )
        await client.broadcast_to_types(["booking"], {"alert": "Booking API maintenance"})


def assert_rf009_lines(events: list[dict[str, object]]) -> None:
    """RF-009 scenario 16's hand-off line and scenario 17's selective broadcast line."""
    [handoff] = [e for e in events if e.get("category") == "handoff"]
    assert {k: handoff[k] for k in ("from_agent", "to_agent", "workflow_id", "step_number")} == {
        "from_agent": "CustomerAgent",
        "to_agent": "SellerAgent",
        "workflow_id": "wf_refund_123",
        "step_number": 2,
    }
    assert handoff["task_description"] == "Approve refund"
    assert handoff["constraints"] == {"refund_method": "original_payment"}
    assert handoff["context_size_kb"] > 0 and handoff["timestamp"]  # type: ignore[operator]
    [broadcast] = [e for e in events if e.get("category") == "broadcast"]
    assert broadcast["agent_types"] == ["booking"]
    assert broadcast["recipients"] == ["SellerAgent"]


@pytest.mark.parametrize(("level", "written"), [((), True), (("--log-level", "ERROR"), False)])
async def test_the_broker_logs_hand_offs_and_broadcasts_by_default(
    level: tuple[str, ...], written: bool
) -> None:
    """RF-009 scenarios 16 and 17: a structured line per hand-off and per (selective)
    broadcast, at the default log level; --log-level ERROR leaves them out."""
    proc = await start(*level, "broker", "--port", "0", ready=r"listening on (\S+?)[,\s]")
    try:
        await hand_off_and_broadcast(proc.address)
    finally:
        assert await stop(proc) == 0
    events = events_in(proc.output)
    if written:
        assert_rf009_lines(events)
    else:
        assert [e for e in events if e.get("category") in ("handoff", "broadcast")] == []


async def test_the_event_log_keeps_the_events_whatever_the_log_level(tmp_path: Path) -> None:
    """RF-009 scenario 16 keeps hand-off logs for 30 days: AGENTMESH_EVENT_LOG (or
    --event-log) writes the structured events to a file of their own, one a day, even when
    the log on stderr leaves them out."""
    path = tmp_path / "logs" / "broker.jsonl"
    proc = await start(
        "--log-level",
        "ERROR",
        "broker",
        "--port",
        "0",
        ready=r"listening on (\S+?)[,\s]",
        env={"AGENTMESH_EVENT_LOG": str(path)},
    )
    try:
        await hand_off_and_broadcast(proc.address)
    finally:
        assert await stop(proc) == 0
    assert [e for e in events_in(proc.output) if "category" in e] == []
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert_rf009_lines(logged)
    assert {e["category"] for e in logged} >= {"registry", "handoff", "broadcast"}
    assert all(e["level"] in ("INFO", "WARNING") for e in logged)


async def test_a_bad_event_log_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for flags, said in (
        (
            ("--event-log", str(tmp_path / "events.jsonl"), "--event-log-days", "0"),
            "an event log keeps at least one day",
        ),
        (("--event-log", str(blocker / "events.jsonl")), "cannot write the event log"),
    ):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mesh.cli",
            *flags,
            "broker",
            "--port",
            "0",
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 2
        assert said in err.decode()


async def test_research_runs_across_processes_on_a_broker_serving_the_tools(
    tmp_path: Path,
) -> None:
    # The tools on the broker (`--tools`), the subagents in a process of their own, the
    # coordinator in the gateway's: what a deployment of separate processes runs.
    reports = tmp_path / "reports"
    broker = await start(
        "broker",
        *("--port", "0", "--tools", "agents.research:tool_host"),
        ready=r"listening on (\S+?)[,\s]",
        env={"AGENTMESH_REPORTS_DIR": str(reports)},
    )
    procs = [broker]
    try:
        assert "tools grep, read, web_fetch, web_search, write)" in broker.output[-1]
        procs.append(
            await start(
                *("agent", "agents.research:research_agents", "--broker", broker.address),
                ready=r"serving on (\S+),",
            )
        )
        gateway = await start(
            *("gateway", "--broker", broker.address, "--port", "0"),
            ready=r"listening on (\S+?)[,\s]",
        )
        procs.append(gateway)
        from gateway.client import GatewayClient

        async with GatewayClient(gateway.address) as client:
            events = await client.collect(
                client.research(
                    query="What is the latest lithium-ion battery recycling rate?",
                    report_name="across",
                )
            )
        result = events[-1]["data"]
        assert events[-1]["kind"] == "RESULT" and result["status"] == "COMPLETED", result
        assert any("46%" in str(f) for f in result["findings"]), result["findings"]
        written = sorted(p.name for p in reports.iterdir())
        assert written == ["across.json", "across.md"]
        assert "46%" in (reports / "across.md").read_text()
    finally:
        for proc in reversed(procs):
            assert await stop(proc) == 0


async def agentmesh(*args: str) -> tuple[int, str]:
    """Runs `agentmesh ARGS` to its end: its exit code and what it wrote to stderr."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "mesh.cli", *args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    return process.returncode or 0, err.decode()


async def test_agents_started_before_their_broker_wait_for_it() -> None:
    """A deployment starts the agents and their broker side by side: `agentmesh agent`
    started first waits for its broker (60 s by default), its server up meanwhile and not
    ready; once the broker serves, the agents register and take their messages. With
    `--wait-for-broker 0` it fails at once, saying why (before, it always did: a Kubernetes
    pod of agents restarted with a growing back-off until the broker was up). Its two agents
    start side by side; the process is ready (`agentmesh.agents`, what its pod's probe asks)
    once both take their messages."""
    port, first = free_port(), free_ports_in_a_row(2)
    address, at = f"127.0.0.1:{port}", f"127.0.0.1:{first}"
    servers = (at, f"127.0.0.1:{first + 1}")
    desk = ("agent", "tests.helpers.process_agents:payment_desk", "--broker", address)
    waiting = r"\bPaymentAgent at (\S+) waits for its broker"  # (not BackupPaymentAgent)
    agent = await start(*desk, "--port", str(first), ready=waiting)
    broker = None
    try:
        assert agent.address == at
        for server in servers:  # (both up while the broker is waited for)
            async with watching(server, wait_for_ready=True) as alive:
                await alive.until(SERVING)  # (liveness)
            assert await health_of(server, "mesh.v1.AgentService") == NOT_SERVING  # (readiness)
            assert await health_of(server, "agentmesh.agents") == NOT_SERVING
        broker = await start("broker", "--port", str(port), ready=BROKER_READY)
        async with watching(at, "agentmesh.agents") as ready:
            await ready.until(SERVING, 20)  # (or TimeoutError)
        for server in servers:  # each agent's server is ready once it takes its messages
            async with watching(server, "mesh.v1.AgentService") as ready:
                await ready.until(SERVING, 5)
        async with connect(address, agent_id="Caller") as client:
            for agent_id in ("PaymentAgent", "BackupPaymentAgent"):
                answer = await client.request(
                    agent_id, {"action": "process_payment", "parameters": {"amount": 1}}
                )
                assert answer.content["pid"] == agent.process.pid
        assert await stop(agent) == 0
    finally:
        await stop(agent)
        if broker is not None:
            await stop(broker)
    code, err = await agentmesh(*desk, "--port", "0", "--wait-for-broker", "0")
    assert code == 1 and "error: UNAVAILABLE: failed to connect" in err, err
    assert "waits for its broker" not in err
    # Stopped while it waits (its pod deleted): it ends at once, not when the wait is over.
    agent = await start(*desk, "--port", "0", ready=waiting)
    signal_process(agent.process, signal.SIGTERM)
    async with asyncio.timeout(10):
        assert await agent.process.wait() == 0
    assert agent.reader is not None
    await agent.reader
    assert "agentmesh agent stopped before its broker could be reached\n" in agent.output


async def test_a_broker_refuses_tools_it_cannot_load() -> None:
    for spec, said in (
        ("agents.research", "--tools must be module:attribute"),
        ("agents.research:nothing", "has no attribute 'nothing'"),
        ("agents.research:research_agents", "is not a ToolHost"),
    ):
        code, err = await agentmesh("broker", "--port", "0", "--tools", spec)
        assert code == 2, (spec, err)
        assert said in err, err


async def test_a_port_in_use_is_said_in_one_line(broker_proc: Proc) -> None:
    """A second broker, gateway or agent on a port that is taken, or a /metrics port that is,
    exits 1 with one line that says so (a traceback of grpc's RuntimeError before)."""
    import socket

    port = broker_proc.address.rsplit(":", 1)[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = str(taken.getsockname()[1])
        for args, said in (
            (("broker", "--port", port), f"cannot listen on 127.0.0.1:{port}: the port is in use"),
            (("broker", "--port", "0", "--metrics-port", metrics), "cannot serve /metrics on"),
            (
                ("gateway", "--broker", broker_proc.address, "--port", port),
                f"cannot listen on 127.0.0.1:{port}",
            ),
            (
                (
                    "agent",
                    "agents.stocks:IndustryExpertAgent",
                    "--broker",
                    broker_proc.address,
                    "--port",
                    port,
                ),
                f"cannot listen on 127.0.0.1:{port}",
            ),
        ):
            code, err = await agentmesh(*args)
            assert code == 1, (args, err)
            assert f"error: {said}" in err and "Traceback" not in err, (args, err)


async def test_up_starts_without_its_event_log_where_it_cannot_write_one(tmp_path: Path) -> None:
    """`up` writes logs/events.jsonl by default; in a folder where that cannot be (a read-only
    image, here a file in the way) it starts anyway and says so. One asked for is refused."""
    (tmp_path / "logs").write_text("in the way")
    flags = ("--gateway-port", "0", "--dashboard-port", "-1", "--metrics-port", "-1")
    proc = await start(
        "up", "--port", "0", *flags, ready=r"agentmesh up: broker (\S+?),", cwd=tmp_path
    )
    assert await stop(proc) == 0
    assert any("no event log: cannot write logs/events.jsonl" in line for line in proc.output)


async def test_a_stopping_broker_tells_its_watchers_to_go_elsewhere() -> None:
    """SIGTERM to a broker with a watch open: the watcher is told at once, with UNAVAILABLE
    (SHUTTING_DOWN), the sign to watch again through another broker, rather than left
    waiting or cut off as if the network had failed."""
    broker = await start("broker", "--port", "0", ready=BROKER_READY)
    try:
        async with connect(broker.address, agent_id="Watcher", retry=NO_RETRY) as client:
            changes = client.watch_state("parcel/")
            assert (await anext(changes)).kind is ChangeKind.SYNCED
            signal_process(broker.process, signal.SIGTERM)
            with pytest.raises(BrokerUnavailableError) as told:
                await asyncio.wait_for(anext(changes), 10)
            assert told.value.reason == "SHUTTING_DOWN", told.value
            assert "shutting down" in told.value.message
    finally:
        assert await stop(broker) == 0


async def test_a_broker_told_to_stop_again_while_it_exits_still_exits_cleanly() -> None:
    """A supervisor that repeats its SIGTERM while the broker shuts down (or a test helper
    that stops what it already stopped) gets exit status 0, not death by the signal."""
    broker = await start("broker", "--port", "0", ready=BROKER_READY)
    signal_process(broker.process, signal.SIGTERM)
    async with asyncio.timeout(15):
        while broker.process.returncode is None:
            signal_process(broker.process, signal.SIGTERM)
            await asyncio.sleep(0.003)
    assert await broker.process.wait() == 0
    assert "agentmesh broker shutting down\n" in broker.output
