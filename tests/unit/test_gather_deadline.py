"""A gather's deadline, in the broker's core: the answers that came before it are all given,
even when the reader gets to them after it; one that comes after it is not taken (its agent
is named as silent, the answer counted as late), however soon after."""

from __future__ import annotations

import asyncio

from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.errors import RequestTimeoutError
from mesh.core.model import AgentInfo, Message, MessageType


async def test_answers_before_the_deadline_count_and_one_after_it_does_not() -> None:
    broker = Broker(BrokerConfig())
    for agent_id in ("early", "late"):
        await broker.register(AgentInfo(agent_id=agent_id, agent_types=("expert",)))
    await broker.register(AgentInfo(agent_id="asker"))
    asked = Message(from_agent="asker", to_agent="", content={"action": "vote"})
    items = broker.gather(asked, agent_types=("expert",), timeout=0.05)

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
    await asyncio.sleep(0.1)  # past the deadline, and the reader not back yet
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
    items = broker.gather(asked, agent_types=("expert",), timeout=0.05)
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
    await asyncio.sleep(0.1)  # the deadline passes with b's answer still unread
    rest = [item async for item in items]
    assert [(item.agent_id, item.error) for item in rest] == [("b", None)]
    assert rest[0].response is not None and rest[0].response.from_agent == "b"
