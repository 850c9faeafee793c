"""A gather's deadline, in the broker's core: the answers that came before it are all given,
even when the reader gets to them after it; one that comes after it is not taken (its agent
is named as silent, the answer counted as late), however soon after."""

from __future__ import annotations

import asyncio

import pytest

from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.errors import RequestTimeoutError
from mesh.core.model import AgentInfo, Message, MessageType

DEADLINE = 0.5
"""The gathers' timeout: long enough that the answers sent "before" it still are on a
loaded machine (at 0.05 s, one came after it once)."""


async def test_answers_before_the_deadline_count_and_one_after_it_does_not() -> None:
    broker = Broker(BrokerConfig())
    for agent_id in ("early", "late"):
        await broker.register(AgentInfo(agent_id=agent_id, agent_types=("expert",)))
    await broker.register(AgentInfo(agent_id="asker"))
    asked = Message(from_agent="asker", to_agent="", content={"action": "vote"})
    items = broker.gather(asked, agent_types=("expert",), timeout=DEADLINE)

    def answer(agent_id: str) -> Message:
        return Message(
            from_agent=agent_id,
            to_agent="asker",
            message_type=MessageType.RESPONSE,
            content={"action": "vote", "by": agent_id},
            correlation_id=asked.message_id,
        )

    first = asyncio.ensure_future(anext(items))  # the copies go out; the reader waits
    await asyncio.sleep(0.01)
    await broker.send(answer("early"))
    assert (await first).agent_id == "early"
    await asyncio.sleep(DEADLINE + 0.1)  # past the deadline, and the reader not back yet
    late = await broker.send(answer("late"))
    assert late.recipients == ()  # not taken: it came after the deadline
    rest = [item async for item in items]
    assert [item.agent_id for item in rest] == ["late"]
    assert isinstance(rest[0].error, RequestTimeoutError)
    assert broker.metrics.totals.late_answers == 1
    assert broker.pending_requests == 0


async def test_an_answer_read_after_the_deadline_that_came_before_it_is_given() -> None:
    broker = Broker(BrokerConfig())
    for agent_id in ("a", "b"):
        await broker.register(AgentInfo(agent_id=agent_id, agent_types=("expert",)))
    asked = Message(from_agent="asker", to_agent="", content={"action": "vote"})
    items = broker.gather(asked, agent_types=("expert",), timeout=DEADLINE)
    first = asyncio.ensure_future(anext(items))
    await asyncio.sleep(0.01)
    for agent_id in ("a", "b"):
        await broker.send(
            Message(
                from_agent=agent_id,
                to_agent="asker",
                message_type=MessageType.RESPONSE,
                content={"action": "vote"},
                correlation_id=asked.message_id,
            )
        )
    assert (await first).agent_id == "a"
    await asyncio.sleep(DEADLINE + 0.1)  # the deadline passes with b's answer still unread
    rest = [item async for item in items]
    assert [(item.agent_id, item.error) for item in rest] == [("b", None)]
    assert rest[0].response is not None and rest[0].response.from_agent == "b"


async def test_a_timeout_says_the_time_the_requester_asked_for() -> None:
    """The broker times a request from what is left of its requester's deadline as it comes
    (0.998 s of 1 s): its timeout says "within 1 s", as the requester asked, not 0.998."""
    broker = Broker(BrokerConfig())
    await broker.register(AgentInfo(agent_id="Desk"))
    asked = Message(from_agent="asker", to_agent="Desk", content={"action": "pay"})
    with pytest.raises(RequestTimeoutError) as timed_out:
        await broker.request(asked, timeout=0.098)
    assert timed_out.value.message == "no response from Desk within 0.098 s"
    for left, said in ((0.998, "1"), (0.25, "0.25"), (1.5, "1.5"), (29.97, "30")):
        assert broker._no_response("Desk", left).message == f"no response from Desk within {said} s"
