"""Models and inference tasks that ``tests/integration/test_gpu_worker.py`` runs in real
``celery worker`` subprocesses (on CPU here; the same code pins and caps on a GPU host).

The worker loads this module with ``-A``; its ``app`` is ``sits_queue``'s own (configured
from SITS_* variables, classes from ``SITS_CONFIG``). Models come from
``SITS_TEST_MODELS``, a directory the test session filled with tiny random models
(:mod:`sits_queue.models.tiny`); the submitting test process registers the same tasks
with :func:`register` and no models (it never loads one).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from celery import Celery

from sits_queue import app
from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.procs import CeleryProcess, celery_command, wait_ready
from sits_queue.workers import cores
from sits_queue.workers.inference import generate
from tests.integration import forkcheck

APP_MODULE = "tests.integration.inference_app"
ROOT = Path(__file__).resolve().parents[2]
#: Causal LMs of one size (different seeds): the eviction test cycles through them.
LMS = ("gpt", "lm-a", "lm-b", "lm-c")
#: Per forward pass of the "slow" model, s: makes a long generation outlast a soft limit
#: (a worker's env may set it: a test that weighs decode time against a limit wants the
#: pause, not the busy host's scheduling, to make up most of a step).
SLOW_FORWARD_S = float(os.environ.get("SITS_TEST_SLOW_FORWARD_S", "0.02"))
#: Seconds the "slow-load" model's loader takes (past a 1 s soft limit).
SLOW_LOAD_S = 2.0
#: ``t.lengths``' pause per call, s: shards queue behind one another long enough to stop.
SHARD_PAUSE_S = 0.3
#: Result timeouts, s: a fresh child's first call imports torch and transformers (allow
#: for a slow CI box); later calls find them loaded.
FIRST_CALL_S = 120
CALL_S = 60
#: Positions at which the "stuck" model's forward hangs (past the warm-up prompt's).
STUCK_AT = 40
#: ``t.batch_echo``'s max_batch.
BATCH_ECHO_MAX = 8
#: The default classes plus ones that make limits observable on a small machine: "one"
#: (a single core), "tiny" / "small" (VRAM limits below / just above a tiny model's
#: weights, enforced on CPU against the estimate), "gpu2" (2 GiB: a real cap on a GPU),
#: "vast" (a cap above any device, so a task may declare more than a host has).
CLASSES_TOML = """
default_class = "medium"
[[classes]]
name = "high"
cpu_cores = 16
vram_gib = 64
max_run_s = 45
weight = 100.0
latency_sla_ms = 800
loss_sensitivity = 0.9
[[classes]]
name = "medium"
cpu_cores = 8
vram_gib = 32
max_run_s = 30
weight = 10.0
latency_sla_ms = 2000
loss_sensitivity = 0.5
[[classes]]
name = "low"
cpu_cores = 4
vram_gib = 8
max_run_s = 10
weight = 1.0
latency_sla_ms = 5000
loss_sensitivity = 0.2
[[classes]]
name = "one"
cpu_cores = 1
vram_gib = 8
max_run_s = 30
weight = 5.0
latency_sla_ms = 2000
loss_sensitivity = 0.5
[[classes]]
name = "tiny"
cpu_cores = 1
vram_gib = 0.0003
max_run_s = 30
weight = 5.0
latency_sla_ms = 2000
loss_sensitivity = 0.5
[[classes]]
name = "small"
cpu_cores = 1
vram_gib = 0.0008
max_run_s = 30
weight = 5.0
latency_sla_ms = 2000
loss_sensitivity = 0.5
[[classes]]
name = "gpu2"
cpu_cores = 2
vram_gib = 2
max_run_s = 30
weight = 5.0
latency_sla_ms = 2000
loss_sensitivity = 0.5
[[classes]]
name = "vast"
cpu_cores = 2
vram_gib = 1024
max_run_s = 10
weight = 1.0
latency_sla_ms = 5000
loss_sensitivity = 0.2
"""


def register_models(app: Celery, root: Path) -> None:
    for name in LMS:
        app.register_model(name, root / name)
    app.register_model("enc", root / "enc")

    @app.model("broken")
    def broken() -> Any:
        raise RuntimeError("simulated: weights file is corrupt")

    @app.model("flaky")
    def flaky() -> Any:
        """The tiny GPT, from a store that times out on the first load of all."""
        from sits_queue.cache.engines import engine_from_path

        failed = root / "flaky-failed-once"
        if not failed.exists():
            failed.touch()
            raise OSError("simulated: the model store timed out")
        return engine_from_path("flaky", root / "gpt", "cpu")

    @app.model("not-a-model")
    def not_a_model() -> Any:
        return 42

    @app.model("slow")
    def slow() -> Any:
        from sits_queue.cache.engines import engine_from_path

        engine = engine_from_path("slow", root / "gpt", "cpu")
        engine.module.register_forward_pre_hook(lambda *_: time.sleep(SLOW_FORWARD_S))
        return engine

    @app.model("stuck")
    def stuck() -> Any:
        """The tiny GPT, whose forward gets stuck (deaf to the soft limit's signal, as a
        hung kernel is) once a sequence reaches STUCK_AT positions: a batch's short
        rows finish, its long one meets the hard limit."""
        from sits_queue.cache.engines import engine_from_path

        engine = engine_from_path("stuck", root / "gpt", "cpu")

        def hook(_: Any, args: Any, kwargs: dict[str, Any]) -> None:
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.shape[-1] >= STUCK_AT:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with contextlib.suppress(Exception):  # SoftTimeLimitExceeded too
                        time.sleep(0.05)

        engine.module.register_forward_pre_hook(hook, with_kwargs=True)
        return engine

    @app.model("slow-load")
    def slow_load() -> Any:
        from sits_queue.cache.engines import engine_from_path

        time.sleep(SLOW_LOAD_S)  # weights from a slow disk
        return engine_from_path("slow-load", root / "gpt", "cpu")


def build_models(root: Path) -> Path:
    """The tiny models the tasks below use, under ``root`` (see :func:`register_models`)."""
    from sits_queue.models import tiny

    for seed, name in enumerate(LMS):
        tiny.build_tiny_causal_lm(root / name, seed=seed)
    tiny.build_tiny_encoder(root / "enc", seed=7)
    return root


def write_config(path: Path) -> Path:
    path.write_text(CLASSES_TOML)
    return path


def client_app(redis_url: str, config_path: Path, main: str) -> Celery:
    """A submitting app with the workers' class table and tasks (and no models)."""
    config = replace(SitsConfig.from_file(config_path), redis_url=redis_url)
    client = make_app(config, main=main)
    register(client)
    return client


def spawn_worker(redis_url: str, config_path: Path, models_dir: Path, log_dir: Path,
                 env: Mapping[str, str] | None = None, concurrency: int | None = None,
                 name: str = "infer", pool: str = "prefork",
                 extra_args: Sequence[str] = ()) -> CeleryProcess:
    """``celery -A tests.integration.inference_app worker``; ``-c`` only if given."""
    full_env = {"SITS_REDIS_URL": redis_url, "SITS_CONFIG": str(config_path),
                "SITS_TEST_MODELS": str(models_dir), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    hostname = f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}@%h"
    args = ["worker", "--loglevel=INFO", f"--pool={pool}", f"--hostname={hostname}",
            "--without-mingle", "--without-gossip"]
    if concurrency is not None:
        args.append(f"--concurrency={concurrency}")
    args.extend(extra_args)
    proc = celery_command(APP_MODULE, args, full_env, log_dir / f"{name}.log", cwd=ROOT)
    proc.hostname = hostname.replace("%h", os.uname().nodename)
    return proc


@contextmanager
def serving(redis_url: str, config_path: Path, models_dir: Path, log_dir: Path, app: Celery,
            env: Mapping[str, str] | None = None, concurrency: int | None = None,
            name: str = "infer", pool: str = "prefork",
            extra_args: Sequence[str] = ()) -> Iterator[CeleryProcess]:
    """A worker of :func:`spawn_worker`, ready (it answers ``app``'s ping), stopped on
    the way out."""
    proc = spawn_worker(redis_url, config_path, models_dir, log_dir, env, concurrency, name,
                        pool, extra_args)
    try:
        wait_ready(app, [proc])
        yield proc
    finally:
        proc.stop(timeout_s=20)


def call(app: Celery, name: str, *args: Any, timeout: float = CALL_S, **options: Any) -> Any:
    """Task ``name``'s result for ``args`` sent with ``options`` (raises its failure)."""
    return app.tasks[name].apply_async(args, **options).get(timeout=timeout)


def register(app: Celery) -> dict[str, Any]:
    models = os.environ.get("SITS_TEST_MODELS")
    if models:
        register_models(app, Path(models))

    @app.inference_task(name="t.describe", model="gpt", shared=False)
    def describe(engine: Any, tag: str) -> dict[str, Any]:
        """What the task saw: its engine, its cores, torch's threads, its process."""
        torch = sys.modules["torch"]
        return {"tag": tag, "key": engine.key, "tier": engine.tier,
                "tokenizer": "tokenizer" in engine.artifacts, "pid": os.getpid(),
                "affinity": list(cores.usable()),
                "torch_threads": torch.get_num_threads(),
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    @app.inference_task(name="t.describe_retried", model="flaky", autoretry_for=(OSError,),
                        retry_kwargs={"countdown": 0.1, "max_retries": 2}, shared=False)
    def describe_retried(engine: Any, tag: str) -> dict[str, Any]:
        return {"tag": tag, "key": engine.key}

    @app.inference_task(name="t.generate_slow", model="slow", shared=False)
    def generate_slow(engine: Any, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        return generate(engine, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)

    @app.inference_task(name="t.hang", model="gpt", shared=False)
    def hang(engine: Any, seconds: float) -> str:
        """Ignores the soft limit (a C extension stuck in a call): only a kill stops it."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except Exception:  # SoftTimeLimitExceeded included, on purpose
                continue
        return "finished"

    @app.task(name="t.ping", shared=False)
    def ping(tag: str) -> str:
        return tag

    @app.task(name="t.wait", shared=False)
    def wait(hold_s: float) -> dict[str, Any]:
        """A plain task that waits (I/O-like): where and when it ran."""
        began = time.time()
        time.sleep(hold_s)
        return {"pid": os.getpid(), "thread": threading.get_ident(), "began": began,
                "ended": time.time()}

    @app.inference_task(name="t.alloc", model="gpt", shared=False)
    def alloc(engine: Any, gib: float, hold_s: float = 0.0, deaf: bool = False
              ) -> dict[str, Any]:
        """Allocate ``gib`` on the engine's device (and keep it ``hold_s``): the VRAM cap.
        ``deaf``: hold it through the soft time limit too (only the hard one stops it)."""
        torch = sys.modules["torch"]
        device = next(engine.module.parameters()).device
        block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
        block.fill_(1)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            try:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            except Exception:  # SoftTimeLimitExceeded included, when deaf
                if not deaf:
                    raise
        allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        del block
        return {"device": str(device), "allocated_bytes": int(allocated)}

    @app.batch_inference_task(name="t.batch_echo", model="gpt", max_batch=BATCH_ECHO_MAX,
                              shared=False)
    def batch_echo(engine: Any, calls: list[Any]) -> list[Any]:
        """Each call's tag with what its batch was; "bad" fails that call alone, "boom"
        fails the whole run, "sleep:<s>" sleeps first (the soft limit), "hang:<s>" sleeps
        through the soft limit (only the hard one stops it)."""
        from sits_queue.errors import InvalidInput

        tags = [c.args[0] for c in calls]
        if "boom" in tags:
            raise RuntimeError("simulated: the batch run crashed")
        if "retry" in tags or "exit" in tags:
            from celery import current_task as running

            if "exit" in tags:
                raise SystemExit(3)
            running.retry(countdown=1, max_retries=1)
        for tag in tags:
            if isinstance(tag, str) and tag.startswith("sleep:"):
                time.sleep(float(tag.split(":")[1]))
            if isinstance(tag, str) and tag.startswith("hang:"):
                deadline = time.monotonic() + float(tag.split(":")[1])
                while time.monotonic() < deadline:
                    try:
                        time.sleep(0.05)
                    except Exception:  # SoftTimeLimitExceeded included, on purpose
                        continue
        from celery import current_task

        # (what the README sends inference tasks to: current_task, its request)
        current = None if current_task is None else \
            [current_task.name, current_task.request.id]
        return [InvalidInput(f"item {t!r} is bad") if t == "bad" else
                {"tag": t, "pid": os.getpid(), "size": len(calls), "key": engine.key,
                 "ids": [c.id for c in calls], "current": current}
                for t in tags]

    @app.inference_task(name="t.lengths", model="gpt", shared=False)
    def lengths(engine: Any, items: list[str]) -> list[int]:
        """One shard's work: the length of each item, after a fixed pause per call."""
        time.sleep(SHARD_PAUSE_S)
        return [len(item) for item in items]

    @app.batch_inference_task(name="t.batch_short", model="gpt", shared=False)
    def batch_short(engine: Any, calls: list[Any]) -> list[Any]:
        return []  # one output per call is owed: every call fails, clearly

    def work_that_exits(tag: str) -> float:
        """A ``work=`` function ending its process on the tag "exit" (it runs in the
        worker's main process)."""
        if tag == "exit":
            raise SystemExit(3)
        return 1.0

    @app.batch_inference_task(name="t.batch_weighed", model="gpt", work=work_that_exits,
                              shared=False)
    def batch_weighed(engine: Any, calls: list[Any]) -> list[Any]:
        return [len(c.args[0]) for c in calls]

    return {"describe": describe, "generate_slow": generate_slow, "hang": hang, "ping": ping,
            "alloc": alloc, "batch_echo": batch_echo, "batch_short": batch_short,
            "batch_weighed": batch_weighed, "lengths": lengths}


tasks = register(app)
forkcheck.register(app)
