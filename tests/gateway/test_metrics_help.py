"""The /metrics HELP texts name the label values the gateway actually uses."""
from __future__ import annotations

from prometheus_client import generate_latest

from router.metrics import GatewayMetrics


def test_prefetch_orders_help_names_the_outcomes_the_proxy_counts():
    # router/proxy.py counts an order as sent, declined (a non-202 answer), failed (no answer) or skipped
    # (no endpoint); the HELP text said "staged", an outcome the gateway never counts.
    text = generate_latest(GatewayMetrics().registry).decode()
    prefix = "# HELP kvgate_prefetch_orders_total"
    help_line = next(line for line in text.splitlines() if line.startswith(prefix))
    for outcome in ("sent", "declined", "failed", "skipped"):
        assert outcome in help_line, help_line
    assert "staged" not in help_line
