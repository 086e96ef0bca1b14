"""OpenTelemetry traces end to end: a producer's publish span and a real worker's run span
share one trace (the context rides in the message headers through the sorted-set
transport), exported over real OTLP/HTTP to a receiver the test runs."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter,
)
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sits_queue import tracing
from sits_queue.app import make_app
from sits_queue.broker.bulk import enqueue_many
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.errors import ConfigError, UnknownModel
from sits_queue.procs import wait_ready
from tests.integration.conftest import ROOT
from tests.integration.inference_app import (
    FIRST_CALL_S,
    build_models,
    client_app,
    spawn_worker,
    write_config,
)
from tests.waiting import wait_for


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace endpoint: keeps every span it is sent, flattened."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for rs in request.resource_spans:
                service = {a.key: a.value.string_value
                           for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.server.spans.append({
                            "name": span.name, "service": service,
                            "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "links": {(link.trace_id.hex(), link.span_id.hex())
                                      for link in span.links},
                            "attributes": {a.key: _value(a.value) for a in span.attributes}})
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def producer_tracing(receiver: Receiver) -> Iterator[TracerProvider]:
    """The submitting side instrumented the way an application would, not globally."""
    provider = TracerProvider(resource=Resource.create({"service.name": "test-producer"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")))
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument(tracer_provider=provider)
    yield provider
    instrumentor.uninstrument()
    provider.shutdown()


def test_a_task_run_on_a_worker_continues_the_producers_trace(
        tmp_path: Path, redis_url: str, receiver: Receiver,
        producer_tracing: TracerProvider) -> None:
    models = build_models(tmp_path / "models")
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, "tracing-client")
    worker = spawn_worker(redis_url, config_path, models, tmp_path, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "sits-worker",
        "OTEL_BSP_SCHEDULE_DELAY": "100"}, concurrency=1, name="traced")
    try:
        wait_ready(app, [worker])
        # When an inference task (cold: the model loads) and a plain one are sent
        result = app.tasks["sits.generate"].apply_async(
            ("the trace", ), {"max_new_tokens": 2}, model="gpt", sla_class="high"
        ).get(timeout=120)
        assert app.tasks["t.ping"].apply_async(("traced",)).get(timeout=60) == "traced"
        # and one whose model cannot be got
        with pytest.raises(UnknownModel):
            app.tasks["sits.generate"].apply_async(
                ("x",), {"max_new_tokens": 2}, model="nowhere", sla_class="low"
            ).get(timeout=60)
        wait_for(lambda: len(receiver.named("run/sits.generate")) == 2
                 and len(receiver.named("run/t.ping")) == 1, 30, "the worker's spans")
    finally:
        worker.stop(timeout_s=20)
        app.close()
    publish, _ = receiver.named("apply_async/sits.generate")
    run, failed = receiver.named("run/sits.generate")
    if run["attributes"].get("sits.model") == "nowhere":
        run, failed = failed, run
    # (a run whose engine could not be got said neither: they were set after the load)
    assert failed["attributes"]["sits.model"] == "nowhere"
    assert failed["attributes"]["sits.sla_class"] == "low"
    # Then the run is the publish's child in one trace, across the two processes
    assert publish["service"] == "test-producer" and run["service"] == "sits-worker"
    assert run["trace_id"] == publish["trace_id"] and run["parent_id"] == publish["span_id"]
    # with what SITS knows about the run, bounded (no ids, no inputs)
    attrs = run["attributes"]
    assert attrs["sits.model"] == "gpt" and attrs["sits.sla_class"] == "high"
    assert attrs["sits.cold"] is True and attrs["sits.affinity"] is False
    assert attrs["sits.cached_tokens"] == result["output"]["cached_tokens"] == 0
    assert attrs["sits.first_token_ms"] == result["sits"]["first_token_ms"] > 0
    # and the cold start as a child span with its phases, as in the result
    (cold,) = receiver.named("sits.cold_start")
    assert cold["trace_id"] == run["trace_id"] and cold["parent_id"] == run["span_id"]
    assert cold["attributes"]["sits.load_ms"] == result["sits"]["load_ms"]
    assert cold["attributes"]["sits.cold_source"] == result["sits"]["source"]
    # a plain task is traced too, without sits.* attributes
    (ping,) = receiver.named("run/t.ping")
    assert not any(k.startswith("sits.") for k in ping["attributes"])


def test_a_batchs_members_carry_its_attributes_and_it_records_its_cold_start(
        tmp_path: Path, redis_url: str, receiver: Receiver,
        producer_tracing: TracerProvider) -> None:
    models = build_models(tmp_path / "models")
    config_path = write_config(tmp_path / "sits.toml")
    app = client_app(redis_url, config_path, "batch-tracing-client")
    # Given six embeddings waiting before any worker exists: its first pick takes them as
    # one batch, which loads the encoder (cold) before any member's own run span begins
    sent = [app.tasks["sits.embed"].apply_async((f"text {i}",), model="enc", sla_class="high")
            for i in range(6)]
    worker = spawn_worker(redis_url, config_path, models, tmp_path, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        concurrency=1, name="batch-traced")
    try:
        wait_ready(app, [worker])
        results = [s.get(timeout=FIRST_CALL_S) for s in sent]
        wait_for(lambda: len(receiver.named("run/sits.embed")) == 6, 30, "the run spans")
    finally:
        worker.stop(timeout_s=20)  # (its child flushes what spans it still holds)
        app.close()
    assert {r["sits"]["batch"]["size"] for r in results} == {6}
    assert all(r["sits"]["cold"] for r in results)
    # Then each member's run span says what the batch's run was, as a lone run's does
    runs = receiver.named("run/sits.embed")
    for run in runs:
        attrs = run["attributes"]
        assert attrs["sits.model"] == "enc" and attrs["sits.sla_class"] == "high"
        assert attrs["sits.cold"] is True and attrs["sits.affinity"] is False
    # and the batch's inference is a span of its own, in the first member's trace and
    # linked to every member's publish, with the one cold start as its child
    publishes = receiver.named("apply_async/sits.embed")
    (batch,) = receiver.named("run_batch/sits.embed")
    assert batch["links"] == {(p["trace_id"], p["span_id"]) for p in publishes}
    assert batch["trace_id"] in {p["trace_id"] for p in publishes}
    (cold,) = receiver.named("sits.cold_start")
    assert cold["parent_id"] == batch["span_id"] and cold["trace_id"] == batch["trace_id"]
    assert cold["attributes"]["sits.model"] == "enc"
    assert cold["attributes"]["sits.load_ms"] == results[0]["sits"]["load_ms"]


def test_modes() -> None:
    assert tracing.resolve_mode("auto", {}) == "off"
    assert tracing.resolve_mode("auto", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) \
        == "otlp"
    assert tracing.resolve_mode("auto", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x"}) == "otlp"
    assert tracing.resolve_mode("console", {}) == "console"
    assert tracing.configure("off") is False
    with pytest.raises(ConfigError, match="otel_traces"):
        tracing.resolve_mode("jaeger", {})
    with pytest.raises(ConfigError, match="otel_traces"):
        SitsConfig(otel_traces="jaeger")


def test_bulk_publish_spans_each_hang_from_the_caller_and_leave_it_current(
        redis_url: str, redis_client: Any) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument(tracer_provider=provider)
    app = make_app(SitsConfig(redis_url=redis_url), main="bulk-traced")

    @app.task(name="t.bulk_echo", shared=False)
    def echo(tag: str) -> str:
        return tag

    tracer = provider.get_tracer("caller")
    try:
        with tracer.start_as_current_span("caller") as caller:
            enqueue_many(echo, [("a",), ("b",), ("c",)], chunk=2)  # 2 chunks
            # the caller's span is current again, not a publish span that has ended
            assert trace.get_current_span() is caller
    finally:
        instrumentor.uninstrument()
        app.close()
    publishes = [s for s in spans.get_finished_spans() if s.name == "apply_async/t.bulk_echo"]
    root = next(s for s in spans.get_finished_spans() if s.name == "caller")
    assert len(publishes) == 3
    # each publish is the caller's child, not the previous message's
    assert {s.parent.span_id for s in publishes if s.parent} == {root.context.span_id}


OWN_PROVIDER = """
import json, os, sys
import sits_queue  # the app is made here, with an OTLP endpoint set
from celery import current_app
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

spans = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)  # the application's own, set up after the import
CeleryInstrumentor().instrument(tracer_provider=provider)

@sits_queue.app.task(name="t.own_provider", shared=False)
def own() -> None:
    return None

own.delay()
print(json.dumps({"ours": trace.get_tracer_provider() is provider,
                  "spans": [s.name for s in spans.get_finished_spans()]}))
"""


def test_a_tracer_provider_the_application_sets_up_after_the_import_is_used(
        redis_url: str) -> None:
    """(``import sits_queue`` made the app and set up SITS's provider at once: the
    application's own came second, was refused, and its exporter got no span)"""
    env = {**os.environ, "SITS_REDIS_URL": redis_url,
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    out = subprocess.run([sys.executable, "-c", OWN_PROVIDER], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"ours": True, "spans": ["apply_async/t.own_provider"]}
    assert "Overriding of current TracerProvider is not allowed" not in out.stderr


BULK_ONLY = """
import json, sys
from sits_queue.app import make_app
from sits_queue.broker.bulk import enqueue_many
from sits_queue.config import SitsConfig
from sits_queue import tracing

app = make_app(SitsConfig(redis_url=sys.argv[1], otel_traces="console"), main="bulk-only")

@app.task(name="t.bulk_only", shared=False)
def echo(tag: str) -> str:
    return tag

enqueue_many(echo, [("a",), ("b",)])
print("RESULT", json.dumps({"configured": bool(tracing._configured)}), flush=True)
"""


def test_a_producer_that_only_enqueues_in_bulk_sends_its_trace_context(
        redis_url: str, redis_client: Any) -> None:
    """(tracing is set up when the app is finalized, which enqueue_many did not do: such
    a producer sent no traceparent, and each task's run was a trace of its own)"""
    out = subprocess.run([sys.executable, "-c", BULK_ONLY, redis_url], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(result.removeprefix("RESULT ")) == {"configured": True}
    keys = QueueKeys.for_queue("celery")
    headers = [json.loads(redis_client.hget(keys.payloads, i))["headers"]
               for i in redis_client.zrange(keys.waiting, 0, -1)]
    assert len(headers) == 2 and all("traceparent" in h for h in headers), headers
