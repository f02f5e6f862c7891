"""The /metrics HELP texts name the label values the gateway actually uses."""
from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from router.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_prefetch_orders_help_names_the_outcomes_the_proxy_counts():
    # router/proxy.py counts an order as sent, declined (not accepted: refused, non-202) or failed
    # (timeout); the HELP text said "staged", an outcome the gateway never counts.
    proxy = (ROOT / "router" / "proxy.py").read_text()
    assert '"sent" if ok else "declined"' in proxy and '"failed"' in proxy
    text = generate_latest(GatewayMetrics().registry).decode()
    prefix = "# HELP kvgate_prefetch_orders_total"
    help_line = next(line for line in text.splitlines() if line.startswith(prefix))
    for outcome in ("sent", "declined", "failed"):
        assert outcome in help_line, help_line
    assert "staged" not in help_line
