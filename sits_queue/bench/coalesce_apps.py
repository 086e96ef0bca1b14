"""The apps ``sitsq bench coalesce`` runs in its ``celery worker`` subprocesses.

Selected by environment (the worker imports this module with ``-A``):

* ``celery_per_task``: stock Celery (results in Redis, as for SITS); the task keeps the
  encoder loaded in a module global (warm from the first task on, as a careful Celery
  user writes it) and embeds its one text;
* ``sits``: the built-in ``sits.embed`` of a SITS app, the encoder registered as a
  model; ``SITS_COALESCE_SETTINGS`` (JSON) holds ``SitsConfig`` settings (the
  one-at-a-time run sets ``batch_window`` 0; ``sits_joins`` sets ``batch_join`` on:
  continuous batching, which ``auto`` leaves off on a CPU host).

Both embed with the same function (:func:`sits_queue.workers.inference.embed`), so what
differs is how tasks reach the model; likewise they generate (a small causal LM, greedy,
:data:`GEN_TOKENS` new tokens): the plain task one prompt per call through
``inference.generate``, SITS through ``sits.generate_batched``. Every finished task
pushes a record (its id, when it finished, how many tasks its run served) to a Redis
list the benchmark reads.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

from sits_queue.app import make_app
from sits_queue.config import SitsConfig
from sits_queue.workers import cores

SYSTEMS = ("celery_per_task", "sits_one_by_one", "sits_batched", "sits_joins")
#: Systems that run the generation streams only: batching with continuous batching on
#: (on a CPU host the default, ``auto``, leaves it off).
GEN_ONLY = ("sits_joins",)
PLAIN_TASK = "bench.coalesce.embed"
SITS_TASK = "sits.embed"
MODEL = "enc"
PLAIN_GEN_TASK = "bench.coalesce.generate"
SITS_GEN_TASK = "sits.generate_batched"
LM_MODEL = "lm"
#: New tokens per generation (fixed: no stop at EOS, the same work everywhere).
GEN_TOKENS = 8
DONE_KEY = "bench:coalesce:done"
ENV_SYSTEM = "SITS_COALESCE_SYSTEM"
ENV_URL = "SITS_COALESCE_REDIS_URL"
ENV_MODEL = "SITS_COALESCE_MODEL_DIR"
ENV_LM = "SITS_COALESCE_LM_DIR"
ENV_SETTINGS = "SITS_COALESCE_SETTINGS"


def settings_of(system: str) -> dict[str, Any]:
    """``SitsConfig`` settings of a SITS system. The embedding cache is off: the streams'
    texts repeat (a quarter of the burst), and SITS served those from its cache while
    stock Celery ran the model on each: the comparison is of the work's scheduling."""
    own = {"embed_cache_entries": 0}
    if system == "sits_one_by_one":
        return {**own, "batch_window": 0}
    return {**own, "batch_join": "on"} if system == "sits_joins" else own


def worker_env(system: str, url: str, model_dir: Path, lm_dir: Path) -> dict[str, str]:
    return {ENV_SYSTEM: system, ENV_URL: url, ENV_MODEL: str(model_dir), ENV_LM: str(lm_dir),
            ENV_SETTINGS: json.dumps(settings_of(system)), "TOKENIZERS_PARALLELISM": "false"}


# -- the plain Celery side ------------------------------------------------------------------

_encoder: list[Any] = []


def _load(model_dir: Path) -> Any:
    """The encoder as the plain task keeps it: loaded on first use, then module-global."""
    if not _encoder:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from sits_queue.bench.coldstart_apps import Loaded, tensor_bytes

        torch.set_num_threads(len(cores.usable()))
        module: Any = AutoModel.from_pretrained(model_dir)
        module = module.eval()
        size = tensor_bytes([*module.parameters(), *module.buffers()])
        _encoder.append(Loaded(MODEL, module,
                               {"tokenizer": AutoTokenizer.from_pretrained(model_dir)}, size))
    return _encoder[0]


_lm: list[Any] = []


def _register_plain(app: Celery, model_dir: Path, lm_dir: Path) -> None:
    @app.task(name=PLAIN_TASK, shared=False)  # type: ignore[untyped-decorator]
    def embed_task(text: str) -> list[float]:
        from sits_queue.workers.inference import embed

        vector: list[float] = embed(_load(model_dir), text)
        return vector

    @app.task(name=PLAIN_GEN_TASK, shared=False)  # type: ignore[untyped-decorator]
    def generate_task(prompt: str, max_new_tokens: int) -> dict[str, Any]:
        from sits_queue.bench.coldstart_apps import load_from_disk
        from sits_queue.workers.inference import generate

        if not _lm:  # module-global, as for the encoder
            _lm.append(load_from_disk(LM_MODEL, lm_dir, "cpu")[0])
        return generate(_lm[0], prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)


# -- records -------------------------------------------------------------------------------

def _connect_records(app: Celery, url: str, task_names: tuple[str, ...]) -> None:
    clients: dict[int, redis.Redis] = {}

    def on_postrun(task_id: str = "", task: Any = None, retval: Any = None,
                   state: str | None = None, **_: Any) -> None:
        if getattr(task, "app", None) is not app or task.name not in task_names:
            return
        meta = retval.get("sits") if isinstance(retval, dict) else None
        size = (meta.get("batch") or {}).get("size", 1) if isinstance(meta, dict) else 1
        record = {"id": task_id, "fin": time.time(), "size": size, "state": state,
                  "error": None if state == "SUCCESS" else repr(retval)[:300]}
        pid = os.getpid()  # a forked child must not reuse its parent's socket
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(url)
        clients[pid].rpush(DONE_KEY, json.dumps(record))

    signals.task_postrun.connect(on_postrun, weak=False)


def build(system: str, url: str, model_dir: Path, lm_dir: Path,
          settings: dict[str, Any] | None = None) -> Celery:
    """The app of ``system`` on database ``url``."""
    app: Celery
    if system == "celery_per_task":
        # Stock settings, on purpose, with the results kept (the caller wants its vector).
        app = Celery("bench_coalesce_celery", broker=url, backend=url)
        _register_plain(app, model_dir, lm_dir)
    elif system in ("sits_one_by_one", "sits_batched", "sits_joins"):
        config = replace(SitsConfig(redis_url=url), **(settings or {}))
        app = make_app(config, main=f"bench_coalesce_{system}")
        app.register_model(MODEL, model_dir)
        app.register_model(LM_MODEL, lm_dir)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    _connect_records(app, url, task_names(system))
    return app


def task_names(system: str) -> tuple[str, str]:
    """(embedding task, generation task) of ``system``."""
    if system == "celery_per_task":
        return PLAIN_TASK, PLAIN_GEN_TASK
    return SITS_TASK, SITS_GEN_TASK


_system = os.environ.get(ENV_SYSTEM)
if _system:
    app = build(_system, os.environ[ENV_URL], Path(os.environ[ENV_MODEL]),
                Path(os.environ[ENV_LM]), json.loads(os.environ.get(ENV_SETTINGS) or "{}"))
