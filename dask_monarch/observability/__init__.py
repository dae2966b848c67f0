"""Observability: the dashboard page, worker log forwarding."""
