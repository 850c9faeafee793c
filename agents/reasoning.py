"""The one seam behind which the sample agents reason: deterministic rules by default, or any
OpenAI-compatible chat-completions endpoint (base URL, model and key by configuration)."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from mesh import Agent

Rule = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class Reasoner(Protocol):
    """Performs one reasoning step (``task``: "propose", "review", ...) on JSON inputs and
    returns a JSON object with the fields the task's schema names."""

    async def complete(self, task: str, inputs: dict[str, Any], schema: str) -> dict[str, Any]: ...


class RuleReasoner:
    """The offline default: the agent's own deterministic rules over its data files."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    async def complete(self, task: str, inputs: dict[str, Any], schema: str) -> dict[str, Any]:
        return await self.rule(task, inputs)


class ReasoningError(RuntimeError):
    """The model endpoint failed or answered with something that is not the JSON asked for."""


class ChatCompletionsReasoner:
    """Asks an OpenAI-compatible ``POST {base_url}/chat/completions`` for a JSON answer."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "",
        *,
        timeout: float = 60.0,
        system: str = "You are an agent of a multi-agent system.",
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.system = system

    async def complete(self, task: str, inputs: dict[str, Any], schema: str) -> dict[str, Any]:
        body = {
            "model": self.model,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "messages": [
                {
                    "role": "system",
                    "content": f"{self.system} Task: {task}. Answer ONLY with a "
                    f"JSON object of this shape: {schema}",
                },
                {"role": "user", "content": json.dumps(inputs, default=str)},
            ],
        }
        raw = await asyncio.to_thread(self._post, body)
        try:
            text = raw["choices"][0]["message"]["content"]
            answer = json.loads(text)
        except (KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
            raise ReasoningError(f"the model's answer is not the JSON asked for: {exc}") from None
        if not isinstance(answer, dict):
            raise ReasoningError("the model's answer is not a JSON object")
        return answer

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"  # never logged
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data: dict[str, Any] = json.loads(response.read())
                return data
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as exc:
            raise ReasoningError(f"chat completions call failed: {exc}") from None


def reasoner_from_env(rule: Rule, environ: Mapping[str, str] | None = None) -> Reasoner:
    """AGENTMESH_LLM_BASE_URL (and _MODEL, _API_KEY) selects a model endpoint; else the rules."""
    env = os.environ if environ is None else environ
    base_url = env.get("AGENTMESH_LLM_BASE_URL", "")
    if not base_url:
        return RuleReasoner(rule)
    return ChatCompletionsReasoner(
        base_url,
        env.get("AGENTMESH_LLM_MODEL", "gpt-4o-mini"),
        env.get("AGENTMESH_LLM_API_KEY", ""),
    )


class ReasoningAgent(Agent):
    """A sample agent that reasons through a :class:`Reasoner`: its own rules (:meth:`_rules`)
    over its data files (``data_dir``: the package's own by default), unless
    ``AGENTMESH_LLM_BASE_URL`` names a model endpoint or ``reasoner`` is given."""

    def __init__(
        self,
        agent_id: str | None = None,
        *,
        data_dir: str | Path | None = None,
        reasoner: Reasoner | None = None,
    ) -> None:
        super().__init__(agent_id)
        self.data_dir = data_dir
        self.reasoner = reasoner or reasoner_from_env(self._rules)

    async def _rules(self, task: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """The deterministic answer to one reasoning step (each agent has its own)."""
        raise NotImplementedError
