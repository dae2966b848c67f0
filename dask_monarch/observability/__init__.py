"""Observability: the dashboard page, worker log forwarding, the progress line."""
