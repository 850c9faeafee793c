"""The live dashboard served beside the gateway (see :mod:`gateway.dashboard.server`)."""

from gateway.dashboard.server import Dashboard, DashboardServer, serve_dashboard

__all__ = ["Dashboard", "DashboardServer", "serve_dashboard"]
