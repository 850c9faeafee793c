"""The gateway orchestrator: multi-agent patterns (RF-010) run over the mesh, streamed over gRPC."""

from gateway.dispatch import BrokerDispatcher, Dispatcher, MeshDispatcher
from gateway.events import EventKind, Pattern, PatternEvent
from gateway.patterns.collaborative import FilteringSpec, run_filtering
from gateway.patterns.group_chat import GroupChatSpec, aggregate, run_group_chat
from gateway.patterns.handoff import WorkflowSpec, WorkflowStep, run_workflow
from gateway.patterns.orchestrator import Route, Router, run_parallel

__all__ = [
    "BrokerDispatcher",
    "Dispatcher",
    "EventKind",
    "FilteringSpec",
    "GroupChatSpec",
    "MeshDispatcher",
    "Pattern",
    "PatternEvent",
    "Route",
    "Router",
    "WorkflowSpec",
    "WorkflowStep",
    "aggregate",
    "run_filtering",
    "run_group_chat",
    "run_parallel",
    "run_workflow",
]
