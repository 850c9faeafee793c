"""The Tool gRPC service: a thin translation onto a ToolHost."""

from __future__ import annotations

import time
from typing import Any

from mesh import codec
from mesh.core.tools import ToolHost
from mesh.server import _invalid
from mesh.v1 import tools_pb2, tools_pb2_grpc

TOOL_SERVICE = tools_pb2.DESCRIPTOR.services_by_name["ToolService"].full_name


class ToolServicer(tools_pb2_grpc.ToolServiceServicer):
    def __init__(self, host: ToolHost) -> None:
        self.host = host

    async def InvokeTool(
        self, request: tools_pb2.InvokeToolRequest, context: Any
    ) -> tools_pb2.InvokeToolResponse:
        if not request.agent_id or not request.tool:
            raise _invalid("tool", "agent_id and tool are required")
        timeout = codec.timeout_seconds(request)
        if timeout is None:
            timeout = 10.0
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        started = time.perf_counter()
        result = await self.host.invoke(
            request.agent_id, request.tool, codec.struct_to_dict(request.arguments), timeout
        )
        response = tools_pb2.InvokeToolResponse()
        codec.python_to_value(result, response.result)
        codec.seconds_to_duration(time.perf_counter() - started, response.duration)
        return response

    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: Any
    ) -> tools_pb2.ListToolsResponse:
        tools = (
            self.host.allowed(request.agent_id)
            if request.agent_id
            else list(self.host.tools.values())
        )
        return tools_pb2.ListToolsResponse(
            tools=[tools_pb2.ToolSpec(name=t.name, description=t.description) for t in tools]
        )
