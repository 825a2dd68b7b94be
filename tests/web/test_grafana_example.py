"""The Grafana example queries only series a running server exports, and the Prometheus example
scrapes /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import API_KEY

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "examples" / "grafana" / "pagedserve-dashboard.json"
PROMETHEUS = REPO / "examples" / "prometheus" / "prometheus.yml"

pytestmark = pytest.mark.slow


def queried_series(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names.update(re.findall(r"pagedserve:[a-zA-Z0-9_:]+", target["expr"]))
    return names


def exported_series(metrics_text: str) -> dict[str, set[str]]:
    """Sample name -> the label names seen on it."""
    series: dict[str, set[str]] = {}
    for line in metrics_text.splitlines():
        match = re.match(r"^(pagedserve:[a-zA-Z0-9_:]+)(?:\{(.*)\})? ", line)
        if match:
            labels = {part.split("=")[0] for part in re.findall(r'[a-zA-Z_]+="', match.group(2) or "")}
            series.setdefault(match.group(1), set()).update(label.rstrip('="') for label in labels)
    return series


def test_every_queried_series_is_exported(web_server):
    # one finished request, so the histograms and finish-reason counters have samples
    response = httpx.post(
        web_server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "Hello", "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200
    dashboard = json.loads(DASHBOARD.read_text())
    queried = queried_series(dashboard)
    assert len(queried) >= 10
    exported = exported_series(web_server.get("/metrics").text)
    missing = sorted(name for name in queried if name not in exported)
    assert missing == []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for label in re.findall(r"by \(([a-z_, ]+)\)", target["expr"]):
                for name in re.findall(r"pagedserve:[a-zA-Z0-9_:]+", target["expr"]):
                    wanted = {part.strip() for part in label.split(",")} - {"le"}
                    assert wanted <= exported[name], (name, wanted)


def test_prometheus_example_scrapes_metrics():
    text = PROMETHEUS.read_text()
    assert "metrics_path: /metrics" in text
    assert re.search(r'targets: \["127\.0\.0\.1:\d+"\]', text)
