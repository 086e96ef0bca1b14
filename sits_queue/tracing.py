"""Traces in OpenTelemetry form (MISSION §5): every task's publish and run as spans, with
the trace context carried in the message headers from producer to worker.

Celery's own OpenTelemetry instrumentation (``opentelemetry-instrumentation-celery``)
does the spans and the propagation (a ``traceparent`` header, which the sorted-set
transport keeps like any header); this module only sets it up and adds what SITS knows
about a run: its class, model, whether it paid a cold start (and a child span with the
phases), affinity, cached prompt tokens. Attribute values are bounded: classes and
models come from configuration, never task ids or inputs.

A batch (``workers/batched.py``) runs its inference before any member's run span
begins: :func:`batch_span` gives it a span of its own for that (the cold start's parent),
and each member's run span is annotated afterwards with what that span was.

``otel_traces`` (``SITS_OTEL_TRACES``): ``auto`` (on when ``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set), ``otlp`` (OTLP over HTTP, configured
by the standard ``OTEL_EXPORTER_OTLP_*`` variables), ``console``, or ``off``. A tracer
provider the application set up itself (before the app is finalized: its first task
call, a worker's start) is used as it is.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sits_queue.errors import ConfigError

logger = logging.getLogger(__name__)

MODES = ("auto", "otlp", "console", "off")
#: The instrumentation scope of SITS's own spans.
SCOPE = "sits_queue"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_INSTALL_HINT = "pip install 'sits-queue[otel]'"

_lock = threading.Lock()
_configured: list[Any] = []  # the provider, once configured in this process
#: The batch spans open now (innermost last), each with the attributes annotated on it.
_batches: list[tuple[Any, dict[str, Any]]] = []


def resolve_mode(mode: str, env: Mapping[str, str]) -> str:
    """``otlp``, ``console`` or ``off`` for a configured ``mode`` (``auto`` looks for an
    OTLP endpoint in ``env``)."""
    if mode not in MODES:
        raise ConfigError(f"otel_traces must be one of {list(MODES)}, got {mode!r}")
    if mode == "auto":
        return "otlp" if any(env.get(v) for v in _ENDPOINT_VARS) else "off"
    return mode


def _not_installed(mode: str) -> ConfigError:
    return ConfigError(f"otel_traces={mode!r} needs OpenTelemetry: {_INSTALL_HINT}")


def configure_when_finalized(app: Any, mode: str) -> None:
    """Check ``mode`` now (a ConfigError when it cannot be had), and set tracing up when
    ``app`` is finalized: at its first task call in a producer, at start in a worker
    (before its pool forks). Not when the app is made: ``import sits_queue`` makes it,
    and an application that set up its own tracer provider after that import found it
    replaced by SITS's (OpenTelemetry refuses a second one)."""
    resolved = resolve_mode(mode, os.environ)
    if resolved != "off" and mode != "auto":
        try:
            import opentelemetry.instrumentation.celery
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError as exc:
            raise _not_installed(mode) from exc
    if app.finalized:
        configure(mode)
        return
    app.on_after_finalize.connect(lambda sender=None, **_: configure(mode), weak=False)


def configure(mode: str, env: Mapping[str, str] | None = None) -> bool:
    """Set up tracing for this process (once); True when spans are being recorded.

    Called when the app is finalized (:func:`configure_when_finalized`), so producers
    and the worker's main process have it; pool children inherit it (the SDK's batch
    processor restarts its thread after a fork) and flush it when they exit
    (:func:`flush`).
    """
    resolved = resolve_mode(mode, os.environ if env is None else env)
    if resolved == "off":
        return False
    with _lock:
        if _configured:
            return True
        try:
            provider = _provider(resolved)
            from opentelemetry.instrumentation.celery import CeleryInstrumentor
        except ImportError as exc:
            if mode == "auto":
                logger.warning("an OTLP endpoint is set but OpenTelemetry is not installed "
                               "(%s): no traces; %s", exc, _INSTALL_HINT)
                return False
            raise _not_installed(mode) from exc
        instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
        _configured.append(provider)
        return True


def _provider(mode: str) -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # the application configured its own
        return current
    exporter: Any
    if mode == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_* decide where and how
    service = os.environ.get("OTEL_SERVICE_NAME") or "sits-queue"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered (a pool child about to exit)."""
    for provider in _configured:
        try:
            provider.force_flush(timeout_ms)
        except Exception as exc:  # an exporter failing must not stop a worker exiting
            logger.warning("could not flush traces: %s", exc)


def annotate(attributes: Mapping[str, Any]) -> None:
    """Add bounded ``sits.*`` attributes to the current span (the task's run, or a
    batch's: :func:`batch_span`), if any."""
    span = _current_span()
    if span is None:
        return
    given = {k: v for k, v in attributes.items() if v is not None}
    span.set_attributes(given)
    if _batches and _batches[-1][0] is span:
        _batches[-1][1].update(given)


@contextmanager
def batch_span(name: str, carriers: Sequence[Mapping[str, Any]], said: dict[str, Any]
               ) -> Iterator[None]:
    """The current span while a batch's inference runs, before its members' own run
    spans begin (so that :func:`annotate` and :func:`record_span` find one): in the
    trace of the first member that has one, linked to every member's (``carriers``:
    their message headers). What is annotated on it is also added to ``said``, for the
    caller to annotate each member's run span with."""
    if not _configured:
        yield
        return
    from opentelemetry import propagate, trace

    contexts = [propagate.extract(carrier) for carrier in carriers]
    members = [trace.get_current_span(c).get_span_context() for c in contexts]
    links = [trace.Link(member) for member in members if member.is_valid]
    parent = next((c for c, m in zip(contexts, members, strict=True) if m.is_valid), None)
    with trace.get_tracer(SCOPE).start_as_current_span(name, context=parent,
                                                       links=links) as span:
        _batches.append((span, said))
        try:
            yield
        finally:
            _batches.pop()


def record_span(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> None:
    """A finished child span of the current one (a cold start, timed by the caller)."""
    span = _current_span()
    if span is None:
        return
    from opentelemetry import trace

    tracer = trace.get_tracer(SCOPE)
    child = tracer.start_span(name, start_time=start_ns,
                              context=trace.set_span_in_context(span))
    child.set_attributes({k: v for k, v in attributes.items() if v is not None})
    child.end(end_time=end_ns)


def _current_span() -> Any:
    if not _configured:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None
