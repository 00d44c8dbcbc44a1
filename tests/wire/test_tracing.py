"""Tracing's flag and its off state (wire/tracing.py): `--otlp-traces-endpoint` on every command
that starts a pdserve process, handed on by `pdserve serve`; without it nothing is set up. The
traces themselves, across real processes: tests/router/test_tracing_e2e.py."""
import subprocess
import sys
from pathlib import Path

import pytest

from wire import tracing

REPO = Path(__file__).resolve().parents[2]
ENDPOINT = "http://127.0.0.1:4317"


def test_without_an_endpoint_nothing_is_set_up():
    """A router (its app built) and a worker's bring-up, in a fresh interpreter: the global tracer
    provider stays the API's proxy, no SDK is imported, the app has no tracing middleware."""
    script = """
import sys
from opentelemetry import trace
from router.__main__ import build_parser, config_from_args
from router.app import create_app
from router.traces import RequestTracing
from serving.bringup import WorkerOptions
from tests.router.harness import tiny_tokenizer
from wire import tracing

config = config_from_args(build_parser().parse_args(["--model", "tiny", "--decode", "127.0.0.1:1"]))
assert config.otlp_traces_endpoint is None
assert tracing.setup(config.otlp_traces_endpoint, "pdserve-router") is False
app = create_app(config, tiny_tokenizer())
assert not any(m.cls is RequestTracing for m in app.user_middleware)
assert tracing.setup(WorkerOptions().otlp_traces_endpoint, "pdserve-decode") is False
assert not tracing.enabled and tracing.tracer() is None
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider), trace.get_tracer_provider()
loaded = sorted(name for name in sys.modules if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")))
assert not loaded, loaded
print("OFF")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("OFF"), result.stdout + result.stderr


def test_the_flag_is_on_every_command_and_checked():
    from deploy.cli import build_parser as serve_parser
    from router.__main__ import build_parser as router_parser
    from decode_worker.__main__ import parse_args as decode_args
    from prefill_worker.__main__ import parse_args as prefill_args
    assert router_parser().parse_args(["--otlp-traces-endpoint", ENDPOINT]).otlp_traces_endpoint == ENDPOINT
    assert decode_args(["--otlp-traces-endpoint", ENDPOINT]).otlp_traces_endpoint == ENDPOINT
    assert prefill_args(["--otlp-traces-endpoint", ENDPOINT]).otlp_traces_endpoint == ENDPOINT
    assert serve_parser().parse_args(["serve", "--otlp-traces-endpoint", ENDPOINT]).otlp_traces_endpoint == ENDPOINT
    assert decode_args([]).otlp_traces_endpoint is None
    with pytest.raises(SystemExit):
        router_parser().parse_args(["--otlp-traces-endpoint", "localhost:4317"])  # no scheme: refused
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        tracing.check_endpoint("grpc://localhost:4317")
    from router.config import RouterConfig
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RouterConfig(decode=["127.0.0.1:1"], otlp_traces_endpoint="4317")


def test_serve_hands_the_endpoint_to_its_routers_and_workers():
    from deploy.cli import build_parser, serve_options
    from serving import worker_options
    from decode_worker.__main__ import parse_args
    options = serve_options(build_parser().parse_args(["serve", "--otlp-traces-endpoint", ENDPOINT]))
    assert options.router_config(port=8000).otlp_traces_endpoint == ENDPOINT
    spec = options.worker_spec({"CPU": 2.0}, started_ray=True)
    assert spec.worker_options("decode", "127.0.0.1").otlp_traces_endpoint == ENDPOINT
    assert worker_options(parse_args(["--otlp-traces-endpoint", ENDPOINT])).otlp_traces_endpoint == ENDPOINT
    plain = serve_options(build_parser().parse_args(["serve"]))
    assert plain.router_config(port=8000).otlp_traces_endpoint is None
    assert plain.worker_spec({"CPU": 2.0}, started_ray=True).worker_options("prefill", "x").otlp_traces_endpoint is None
