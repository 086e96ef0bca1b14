"""A task's engine, in its pool child: from the warm cache at the precision asked
(shared with the request that serves the same), held on the device while the task
runs, and the KV prefixes of the engines getting it pushed out dropped with them."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

from sits_queue.cache.pool import COLD_PHASES
from sits_queue.errors import InferenceError, ModelLoadError, VramLimitExceeded
from sits_queue.workers import gpu, runtime, softsignal


def cold_meta(cold: Any, ctx_ms: float) -> dict[str, Any]:
    return {"cold": bool(cold.cold), "source": cold.source,
            "cuda_ctx_ms": round(float(cold.cuda_ctx_ms) + ctx_ms, 3),
            "load_ms": round(float(cold.load_ms), 3),
            "promote_ms": round(float(cold.promote_ms), 3),
            "warmup_ms": round(float(cold.warmup_ms), 3),
            "evicted": list(cold.evicted), "demoted": list(cold.demoted)}


def cold_seconds(meta: dict[str, Any]) -> float:
    """What a run's cold start took (context, load, promotion, warm-up), s, from its
    ``sits`` meta; 0 for a warm one."""
    if not meta.get("cold"):
        return 0.0
    return sum(float(meta.get(phase) or 0.0) for phase in COLD_PHASES) / 1000.0


def acquire(rt: runtime.ChildRuntime, model: str, precision: str | None = None
            ) -> tuple[Any, Any, dict[str, Any] | None]:
    """The warm engine for ``model`` at ``precision``, how cold its start was, and what
    the precision request got (None without one); errors mapped."""
    from sits_queue.cache import pool
    from sits_queue.cache import precision as precisions
    from sits_queue.registry import load_engine

    spec = rt.app.models.get(model)  # UnknownModel
    asked, served = rt.serving.plan(model, precision, rt.torch_device)
    key = precisions.cache_key(model, asked)

    def load() -> Any:
        engine = load_engine(spec, rt.torch_device)
        if asked is None:
            return engine
        return precisions.convert(engine, asked, rt.torch_device, rt.config.int8_max_kl)

    rt.lift_cap()
    oom: str | None = None
    try:
        # whole: imports cut midway leave the child unable to load anything (softsignal)
        with softsignal.held(f"loading model {model!r} (it stays loaded)"):
            engine, cold = rt.cache().get(key, load)
            if precision is not None and served is None:
                served = engine.artifacts.get("precision")
            if (same := rt.serving.learn(model, asked, engine)) is not None:
                # the conversion changed nothing: one entry for both, not two copies
                engine, moved = rt.cache().rekey(key, same, lambda: load_engine(
                    spec, rt.torch_device))
                if moved is not None:  # the entry served was brought back to the device
                    cold = merged_moves(cold, moved, same)
        return engine, cold, served
    except pool.EngineTooLarge as exc:
        raise VramLimitExceeded(f"model {model!r} does not fit this worker's engine cache: "
                                f"{exc}") from None
    except pool.ModelLoadError as exc:
        cause = exc.cause
        if isinstance(cause, InferenceError):
            # already says what went wrong, in our words; its own cause (the loader's
            # exception) kept: ``autoretry_for`` may name it (workers/autoretry.py)
            raise cause from cause.__cause__
        if not gpu.is_oom(cause):
            # Re-raised as our own error: it pickles and JSON-serialises by message alone.
            raise ModelLoadError(str(exc)) from cause
        oom = str(cause).splitlines()[0][:300]
    # Outside the handler: the failed frames (and the tensors they hold) are gone now.
    gpu.release_memory()
    error = VramLimitExceeded(f"out of device memory loading model {model!r}: {oom}")
    error.at_load = True  # (the device was short then: a retry may find room)
    raise error


def merged_moves(first: Any, then: Any, served: str) -> Any:
    """``first``'s cold start with the engines ``then`` (getting ``served`` back to the
    device) evicted and demoted too; ``served`` itself is no longer demoted (the result
    named an engine demoted that served the task from the device)."""
    return replace(first, evicted=(*first.evicted, *then.evicted),
                   demoted=tuple(d for d in (*first.demoted, *then.demoted) if d != served))


def using(rt: runtime.ChildRuntime, key: str) -> Any:
    """Engine ``key`` held on the device while the task runs it (the cache's ``using``;
    a cache without it holds nothing)."""
    hold = getattr(rt.cache(), "using", None)
    return hold(key) if hold is not None else contextlib.nullcontext()


def drop_prefixes_off_device(rt: runtime.ChildRuntime) -> None:
    """The KV prefixes of engines no longer on the device go with them: their KV sat on
    the device beside them, and affinity would still send their tasks here."""
    store = rt.prefixes()
    warm = rt.cache().warm()
    gone = [key for key in store.models() if warm.get(key) != "device"]
    if gone:
        store.drop(gone)
