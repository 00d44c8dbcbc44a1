"""deploy/grafana/pdserve-dashboard.json: a Grafana dashboard that imports as is, and whose every
PromQL expression names only metrics a router's /metrics exports.

The exposition checked is a real router's (tests/router/harness.py: uvicorn, fake prefill and
decode workers over real gRPC) after two requests, with the goodput planner's collector added
the way deploy/router_process.py adds it (`PlannerMetrics`, which reads the controller's
`planner_status`; here a real `Planner`'s status, no Ray): under `pdserve serve` the planner's
series come from the routers' /metrics too, so no other process is scraped.

"Exported" means the series name Prometheus stores: a counter `x` as `x_total`, a histogram as
`x_bucket` / `x_sum` / `x_count`, a gauge as `x`. A family counts as exported from its `# TYPE`
line alone, samples or not: a labelled counter has none until its first label set is used (no
request shed yet, say), and a dashboard panel for it is still right.
"""
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tests.router.harness import (BackgroundLoop, FakeDecodeWorker, FakePrefillWorker, RouterServer, reply_script,
                                  tiny_tokenizer)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"pdserve:[a-zA-Z0-9_:]+")
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                   "summary": ("", "_sum", "_count"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    out = [(panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append((f"${variable['name']}", query["query"] if isinstance(query, dict) else query))
    return out


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def exported_series(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def cumulative_series(text: str) -> set[str]:
    """The series that only make sense through rate() / increase(): counters, histogram buckets."""
    return {family.name + ("_total" if family.type == "counter" else "_bucket")
            for family in text_string_to_metric_families(text) if family.type in ("counter", "histogram")}


def test_dashboard_is_a_valid_grafana_dashboard():
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert dashboard["id"] is None  # importable into any Grafana: it gets its own id
    # the import dialog asks for the Prometheus data source, which becomes the variable's default
    [ds_input] = dashboard["__inputs"]
    assert (ds_input["name"], ds_input["type"], ds_input["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"
    # ... and only there: the panels follow the variable, so it can be switched after the import
    assert json.dumps(dashboard).count("${DS_PROMETHEUS}") == 2  # the variable's current text and value
    for name in ("router", "worker"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE

    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied = set()
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert {"x", "y", "w", "h"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & occupied, f"{panel['title']!r} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == DATASOURCE, panel["title"]
    for where, expr in expressions(dashboard):
        assert metric_names(expr), f"{where}: {expr} names no pdserve metric"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), where
        for metric in metric_names(expr):
            assert not metric.endswith("_bucket") or "histogram_quantile" in expr, where


def test_dashboard_covers_the_p_d_path_metrics():
    named = set().union(*(metric_names(expr) for _, expr in expressions(load())))
    for metric in ("pdserve:prompt_fill_requests_total", "pdserve:prompt_fill_tokens_total",
                   "pdserve:prompt_fill_kv_bytes_total", "pdserve:disaggregation_degraded",
                   "pdserve:kv_transfer_failures_total", "pdserve:requests_shed_total",
                   "pdserve:request_migrations_total", "pdserve:routing_cache_hits_total",
                   "pdserve:planner_target_workers"):
        assert metric in named, metric
    stats = [p for p in panels(load()) if p["type"] == "stat"]
    assert any("pdserve:disaggregation_degraded" in t["expr"] for p in stats for t in p["targets"])


@pytest.fixture(scope="module")
def exposition():
    """A router over one fake decode and one fake prefill worker, with the planner's collector,
    after two requests (one streamed); its /metrics text."""
    from deploy.config import PoolTargets
    from deploy.planner import Decision, Planner, PlannerConfig
    from deploy.router_process import PlannerMetrics

    loop = BackgroundLoop()
    tokenizer = tiny_tokenizer()
    decode, prefill = FakeDecodeWorker(loop).start(), FakePrefillWorker(loop).start()
    router = None
    try:
        router = RouterServer(loop, RouterConfig(model="tiny", decode=[decode.address], prefill=[prefill.address],
                                                 stats_interval_s=0.2), tokenizer)
        # what the controller's planner_status answers (deploy/controller.py), from a real Planner
        planner = Planner(PlannerConfig())
        planner.decisions.append(Decision(0.0, (1, 1), (1, 2), None, "test"))
        planner.num_decisions = 1
        collector = PlannerMetrics(client=None)
        collector.status = {**planner.status(), "targets": PoolTargets(prefill=1, decode=1).counts()}
        router.state.metrics.registry.register(collector)  # what create_app(collectors=[...]) does

        decode.script = reply_script(tokenizer, "Hello world, hello there!", num_cached_tokens=16, kv_bytes=4096)
        for stream in (False, True):
            response = httpx.post(router.url + "/v1/completions", timeout=30,
                                  json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                                        "stream": stream})
            assert response.status_code == 200, response.text
        yield httpx.get(router.url + "/metrics", timeout=30).text
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.stop()
        loop.close()


def test_every_metric_the_dashboard_names_is_exported(exposition):
    exported = exported_series(exposition)
    assert "pdserve:planner_decisions_total" in exported  # the planner's collector is in
    assert "pdserve:time_to_first_token_seconds_bucket" in exported
    missing = {}
    for where, expr in expressions(load()):
        for metric in sorted(metric_names(expr) - exported):
            missing.setdefault(metric, []).append(where)
    assert not missing, "the dashboard names metrics no router exports: " + "; ".join(
        f"{metric} (in {', '.join(where)})" for metric, where in sorted(missing.items()))


def test_counters_and_buckets_are_read_as_rates(exposition):
    cumulative = cumulative_series(exposition)
    for where, expr in expressions(load()):
        for match in METRIC.finditer(expr):
            if match.group() in cumulative:
                assert expr[:match.start()].endswith(("rate(", "increase(")), f"{where}: {match.group()} as is"


def test_the_per_worker_series_exist_for_both_roles(exposition):
    """The per-worker panels filter on `worker` and group by `role`: both pools are there."""
    roles = {sample.labels.get("role") for family in text_string_to_metric_families(exposition)
             if family.name == "pdserve:worker_healthy" for sample in family.samples}
    assert roles == {"prefill", "decode"}
