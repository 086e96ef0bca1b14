"""Tasks the integration tests run inside real ``celery worker`` subprocesses.

Workers load this module with ``-A``; its ``app`` is ``sits_queue.app`` itself
(configured from SITS_* variables), so the tests exercise exactly what
``celery -A sits_queue worker`` runs. The submitting test process registers the same
tasks on its own app with :func:`register`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Reject, SoftTimeLimitExceeded

from sits_queue import app
from sits_queue.workers.batchmain import BatchRequest
from sits_queue.workers.request import SitsRequest
from tests.integration import forkcheck

_r: dict[int, redis.Redis] = {}


def register(app: Celery) -> dict[str, Any]:
    def r() -> redis.Redis:
        pid = os.getpid()
        if pid not in _r:
            _r[pid] = redis.Redis.from_url(app.sits.redis_url)
        return _r[pid]

    @app.task(name="w.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="w.add_by_replacing", bind=True, shared=False)
    def add_by_replacing(self: Any, x: int, y: int, sla_class: str | None = None) -> Any:
        """``w.add``, by replacing itself with it (Celery's ``Task.replace``), in
        ``sla_class`` if given."""
        return self.replace(add.si(x, y).set(sla_class=sla_class))

    @app.task(name="w.record", shared=False)
    def record(tag: str) -> str:
        """Count every execution, so duplicates show up as runs > distinct tags."""
        r().pipeline().sadd("test:done", tag).incr("test:runs").execute()
        return tag

    @app.task(name="w.slow", sla_class="high", shared=False)
    def slow(tag: str, seconds: float) -> str:
        r().pipeline().incr(f"test:started:{tag}").rpush("test:started", tag).execute()
        time.sleep(seconds)
        r().rpush("test:finished", tag)
        return tag

    @app.task(name="w.past_soft", shared=False)
    def past_soft(tag: str, seconds: float) -> str:
        """Runs ``seconds`` whatever its soft limit says (it catches the signal's
        exception), marking its start."""
        r().set(f"test:started:{tag}", time.time())
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                time.sleep(max(0.0, deadline - time.monotonic()))
            except SoftTimeLimitExceeded:
                continue
        return tag

    @app.task(name="w.mark", shared=False)
    def mark(tag: str, seconds: float, directory: str) -> str:
        """Completion recorded in a file, not Redis: for tests where Redis goes away."""
        time.sleep(seconds)
        (Path(directory) / tag).touch()
        return tag

    def run_steps(task: Any, tag: str, n: int, step_s: float) -> int:
        state = task.checkpoint or {"done": 0, "runs": 0}
        state["runs"] += 1
        r().rpush("test:steps", f"{tag}:start:{state['done']}")
        for i in range(state["done"], n):
            time.sleep(step_s)
            state["done"] = i + 1
            try:
                task.yield_point(state)
            except Exception:
                r().rpush("test:steps", f"{tag}:yield:{state['done']}")
                raise
        r().rpush("test:steps", f"{tag}:end:{state['runs']}")
        return int(state["runs"])

    @app.task(name="w.steps", bind=True, sla_class="low", shared=False)
    def steps(self: Any, tag: str, n: int, step_s: float, retry_once: bool = False) -> int:
        """n steps of step_s seconds, yielding its slot between steps when asked to;
        ``retry_once``: then retries itself once, after its first full run."""
        runs = run_steps(self, tag, n, step_s)
        if retry_once and not self.request.retries:
            raise self.retry(countdown=0.1)
        return runs

    @app.task(name="w.steps_limited", bind=True, sla_class="low", rate_limit="1/h",
              shared=False)
    def steps_limited(self: Any, tag: str, n: int, step_s: float) -> int:
        """``w.steps`` under a rate limit: its one token an hour starts it once."""
        return run_steps(self, tag, n, step_s)

    @app.task(name="w.auto_steps", bind=True, sla_class="low", autoretry_for=(Exception,),
              max_retries=3, retry_backoff=False, default_retry_delay=0, shared=False)
    def auto_steps(self: Any, tag: str, n: int, step_s: float) -> int:
        """``w.steps`` under Celery's autoretry_for=(Exception,): a yield is no error."""
        return run_steps(self, tag, n, step_s)

    @app.task(name="w.requeue", bind=True, shared=False)
    def requeue(self: Any, tag: str, until: int) -> int:
        """Rejects itself with requeue=True until its ``until``-th run."""
        runs = int(r().incr(f"test:requeue:{tag}"))
        if runs < until:
            raise Reject(f"run {runs}: not yet", requeue=True)
        return runs

    @app.task(name="w.refuse", shared=False)
    def refuse(value: str) -> None:
        """Rejects its message for good, saying why."""
        raise Reject(f"input {value!r} is not valid", requeue=False)

    @app.task(name="w.retry_refused", bind=True, shared=False)
    def retry_refused(self: Any) -> None:
        """Retries with an option the broker refuses: Celery turns that into a Reject."""
        raise self.retry(sla_class="nope", countdown=0)

    @app.task(name="w.total", shared=False)
    def total(values: list[int]) -> int:
        """A chord's body: the sum of its header's results."""
        return sum(values)

    @app.task(name="w.flaky", bind=True, max_retries=3, shared=False)
    def flaky(self: Any, tag: str, failures: int) -> dict[str, Any]:
        """Fails its first ``failures`` runs and retries itself after 0.2 s each time."""
        runs = int(r().incr(f"test:flaky:{tag}"))
        if runs <= failures:
            raise self.retry(exc=RuntimeError(f"{tag}: run {runs} failed"), countdown=0.2)
        header = getattr(self.request, "sits", None) or {}
        return {"tag": tag, "runs": runs, "retries": self.request.retries,
                "sla_class": header.get("sla_class"), "model": header.get("model")}

    @app.task(name="w.hourly", rate_limit="1/h", shared=False)
    def hourly(tag: str) -> str:
        return tag

    @app.task(name="w.tenth", rate_limit="10/s", shared=False)
    def tenth(tag: str) -> str:
        return tag

    @app.task(name="w.each_second_or_die", rate_limit="1/s", shared=False)
    def each_second_or_die(tag: str) -> str:
        """``"die"`` kills its worker, main process and all, as a host crash would."""
        if tag == "die":
            os.kill(os.getppid(), signal.SIGKILL)
            os._exit(1)
        return tag

    @app.task(name="w.pid", shared=False)
    def pid() -> int:
        return os.getpid()

    @app.task(name="w.device", sla_class="high", shared=False)
    def device(tag: str, seconds: float = 0.0) -> str | None:
        """The device this child is pinned to, said in Redis as it starts."""
        pinned = os.environ.get("CUDA_VISIBLE_DEVICES")
        r().rpush(f"test:device:{tag}", pinned or "")
        time.sleep(seconds)
        return pinned

    @app.model("w.identity", replace=True)
    def identity() -> Any:
        import torch  # in the pool child, on first use only

        return torch.nn.Identity()

    @app.batch_inference_task(name="w.lengths", model="w.identity", shared=False)
    def lengths(engine: Any, calls: list[Any]) -> list[int]:
        """A batch task: each call's text length."""
        return [len(c.args[0]) for c in calls]

    @app.inference_task(name="w.infer_steps", model="w.identity", sla_class="low",
                        shared=False)
    def infer_steps(engine: Any, tag: str, n: int, step_s: float) -> int:
        """``w.steps`` as an inference task: it cannot bind, so it yields through
        ``celery.current_task`` (the README's way)."""
        from celery import current_task

        return run_steps(current_task, tag, n, step_s)

    @app.task(name="w.memerr", shared=False)
    def memerr(tag: str) -> str:
        """As an allocation too large for host memory fails."""
        raise MemoryError(f"simulated: {tag}")

    @app.batch_inference_task(name="w.lengths_odd", model="w.identity", shared=False)
    def lengths_odd(engine: Any, calls: list[Any]) -> list[Any]:
        """``w.lengths``, failing the call "memerr" with a MemoryError and the call "base"
        with a BaseException that is no Exception."""
        out: list[Any] = []
        for c in calls:
            text = c.args[0]
            out.append(MemoryError(text) if text == "memerr" else
                       Quit(text) if text == "base" else len(text))
        return out

    @app.task(name="w.exits", shared=False)
    def exits(code: int) -> str:
        """A task that calls sys.exit()."""
        sys.exit(code)

    @app.inference_task(name="w.infer_exits", model="w.identity", shared=False)
    def infer_exits(engine: Any, code: int) -> str:
        """An inference task that calls sys.exit()."""
        sys.exit(code)

    @app.batch_inference_task(name="w.lengths_hung", model="w.identity", shared=False)
    def lengths_hung(engine: Any, calls: list[Any]) -> list[int]:
        """``w.lengths``, after marking ``test:started:<first call's text>`` and hanging
        a minute."""
        r().set(f"test:started:{calls[0].args[0]}", 1)
        time.sleep(60)
        return [len(c.args[0]) for c in calls]

    @app.batch_inference_task(name="w.lengths_exits", model="w.identity", shared=False)
    def lengths_exits(engine: Any, calls: list[Any]) -> list[int]:
        """``w.lengths``, but a call "exit" makes the batch function call sys.exit()."""
        if any(c.args[0] == "exit" for c in calls):
            sys.exit(4)
        return [len(c.args[0]) for c in calls]

    @app.batch_inference_task(name="w.batch_device", model="w.identity", sla_class="high",
                              shared=False)
    def batch_device(engine: Any, calls: list[Any]) -> list[str | None]:
        """A batch task: the device this child is pinned to, for each call, and each
        call's tag with the batch's size said in Redis."""
        pinned = os.environ.get("CUDA_VISIBLE_DEVICES")
        for c in calls:
            r().rpush(f"test:device:{c.args[0]}", f"{pinned} {len(calls)}")
        return [pinned for _ in calls]

    @app.model("w.exiting", replace=True)
    def exiting() -> Any:
        raise SystemExit(3)

    @app.inference_task(name="w.use_exiting", model="w.exiting", shared=False)
    def use_exiting(engine: Any) -> str:
        return "never: its loader fails"

    @app.task(name="w.unstartable", Request=UnstartableRequest, shared=False)
    def unstartable() -> str:
        return "never runs"

    @app.batch_inference_task(name="w.lengths_unstartable", model="w.identity",
                              Request=UnstartableBatchRequest, shared=False)
    def lengths_unstartable(engine: Any, calls: list[Any]) -> list[int]:
        """``w.lengths`` whose call "unstartable" Celery raises on before the pool."""
        return [len(c.args[0]) for c in calls]

    return {"add": add, "record": record, "slow": slow, "mark": mark, "pid": pid,
            "device": device, "each_second_or_die": each_second_or_die,
            "steps": steps, "lengths": lengths, "total": total, "flaky": flaky,
            "infer_steps": infer_steps, "unstartable": unstartable,
            "lengths_unstartable": lengths_unstartable, "memerr": memerr,
            "lengths_odd": lengths_odd, "use_exiting": use_exiting, "exits": exits,
            "infer_exits": infer_exits, "lengths_exits": lengths_exits,
            "batch_device": batch_device}


class Quit(BaseException):
    """A BaseException that is no Exception, as a batch function may give for one call."""


class UnstartableRequest(SitsRequest):
    """A request Celery raises on after taking a pool slot for it, as its own
    ``execute_using_pool`` does on a message field no check foresaw: its check for a
    revoke (where malformed stamps raised) fails."""

    def revoked(self) -> bool:
        raise ValueError("this request cannot be started")


class UnstartableBatchRequest(BatchRequest):
    """A batch task's request that Celery raises on when its call is "unstartable"."""

    def revoked(self) -> bool:
        if self.args and self.args[0] == "unstartable":
            raise ValueError("this call cannot be started")
        return bool(super().revoked())


tasks = register(app)
forkcheck.register(app)
