"""The three systems of ``sitsq bench coldstart``, as Celery apps workers load with ``-A``.

``SITS_COLDSTART_SYSTEM`` picks one, ``SITS_COLDSTART_REDIS_URL`` its Redis database
(:func:`system_url`: one database per system), ``SITS_COLDSTART_ZOO`` the directory of
tiny models (``tiny-lm-<i>``) and ``SITS_COLDSTART_BUDGET_BYTES`` the memory budget:

* ``celery_load_per_task``: stock Celery; each task reads its model from disk, runs it
  and drops it;
* ``celery_lru``: stock Celery; a module-level LRU (an ``OrderedDict``) keeps models up
  to the budget, counted as the SITS cache counts them (bytes of distinct parameter and
  buffer tensors), and reads a model from disk on a miss;
* ``sits``: the SITS app, every zoo directory registered with ``app.register_model``,
  an ``@app.inference_task``; the worker's two-tier engine cache takes its budgets from
  ``SITS_DEVICE_CACHE_BYTES`` / ``SITS_HOST_CACHE_BYTES``.

All three decode with the same function (:func:`sits_queue.workers.inference.generate`,
greedy, a fixed number of tokens), so only how a task gets its model differs. A
``task_prerun`` / ``task_postrun`` pair (the same for all) appends one JSON record per
task to :data:`DONE_KEY`: submission, start and finish times, whether the task paid a
cold start, what it cost, where the model came from, and when its first new token came
(MISSION §4.4; ``workers/firsttoken.py``: from the start of the task's run, the load
included, as the SITS worker reports it in ``sits.first_token_ms``).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

from sits_queue.app import make_app
from sits_queue.bench.report import database_url
from sits_queue.broker.keys import AFFINITY_HEADER
from sits_queue.cache.pool import COLD_PHASES
from sits_queue.config import SitsConfig
from sits_queue.workers import cores
from sits_queue.workers.firsttoken import first_token_clock

SYSTEMS = ("celery_load_per_task", "celery_lru", "sits")
#: One database per system, from the URL's on (``report.database_url``).
DATABASES = {"celery_load_per_task": 0, "celery_lru": 1, "sits": 2}
DONE_KEY = "bench:coldstart:done"
TASK_NAME = "bench.coldstart.generate"
#: The SLA class SITS tasks are sent with: "high" confines a child to up to 16 cores, the
#: torch thread count the plain workers get on any host this bench runs on (see _threads).
SITS_CLASS = "high"
ENV_SYSTEM = "SITS_COLDSTART_SYSTEM"
ENV_URL = "SITS_COLDSTART_REDIS_URL"
ENV_ZOO = "SITS_COLDSTART_ZOO"
ENV_BUDGET = "SITS_COLDSTART_BUDGET_BYTES"
#: ``SitsConfig`` settings of the SITS worker, a JSON object (``sitsq bench affinity``,
#: ``prefix``); the SITS_* variables of the environment are not read for the config, so
#: a user's settings do not change a benchmark run.
ENV_SETTINGS = "SITS_COLDSTART_SETTINGS"
_MS_PER_S = 1000.0


def worker_env(system: str, url: str, zoo: Path, budgets: tuple[int, int],
               settings: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The environment of a worker of ``system``: its database, the zoo, the budgets
    (device, host bytes), ``SitsConfig`` settings for SITS, and no network for Hugging
    Face (everything is local)."""
    device_bytes, host_bytes = budgets
    env = {ENV_SYSTEM: system, ENV_URL: url, ENV_ZOO: str(zoo), ENV_BUDGET: str(device_bytes),
           "SITS_REDIS_URL": url, "SITS_DEVICE_CACHE_BYTES": str(device_bytes),
           "SITS_HOST_CACHE_BYTES": str(host_bytes), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if settings:
        env[ENV_SETTINGS] = json.dumps(dict(settings))
    return env


def system_url(base_url: str, system: str) -> str:
    return database_url(base_url, DATABASES[system])


def model_dirs(zoo: Path) -> dict[str, Path]:
    """Model name -> directory, for every built ``tiny-lm-<i>`` under ``zoo``."""
    return {p.name: p for p in sorted(zoo.glob("tiny-lm-*")) if (p / "config.json").is_file()}


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of distinct tensors (tied weights count once), as the SITS cache sizes engines."""
    seen = {id(t): int(t.numel()) * int(t.element_size()) for t in tensors}
    return sum(seen.values())


# -- the plain Celery side ------------------------------------------------------------------

@dataclass
class Loaded:
    """A model as a plain task holds it; shaped like an engine for ``generate``."""

    key: str
    module: Any
    artifacts: dict[str, Any]
    size_bytes: int


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_threads_set = False


def _threads() -> None:
    """torch threads = the process's cores: what SITS's "high" class gives its child."""
    global _threads_set
    if not _threads_set:
        import torch

        torch.set_num_threads(len(cores.usable()))
        _threads_set = True


def load_from_disk(name: str, path: Path, device: str) -> tuple[Loaded, float]:
    """What a plain task does on a miss: ``from_pretrained`` model and tokenizer, to the
    device. Returns the model and the ms it took (the task's cold-start cost)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    # transformers' stubs type .to() oddly: hold the model as Any.
    module: Any = AutoModelForCausalLM.from_pretrained(path)
    module = module.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device != "cpu":
        import torch

        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * _MS_PER_S
    size = tensor_bytes([*module.parameters(), *module.buffers()])
    return Loaded(name, module, {"tokenizer": tokenizer}, size), ms


@dataclass
class LruModels:
    """Models in least-recently-used order, at most ``budget_bytes`` of them together."""

    budget_bytes: int
    entries: OrderedDict[str, Loaded] = field(default_factory=OrderedDict)
    evictions: int = 0

    def get(self, name: str) -> Loaded | None:
        loaded = self.entries.get(name)
        if loaded is not None:
            self.entries.move_to_end(name)
        return loaded

    def put(self, loaded: Loaded) -> None:
        """Keep ``loaded``, dropping the least recently used models to make room; a model
        over the whole budget is not kept (the task still runs it)."""
        if loaded.size_bytes > self.budget_bytes:
            return
        while self.entries and self.used_bytes + loaded.size_bytes > self.budget_bytes:
            self.entries.popitem(last=False)
            self.evictions += 1
        self.entries[loaded.key] = loaded

    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries.values())


def _plain_run(loaded: Loaded, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    from sits_queue.workers.inference import generate

    out = generate(loaded, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)
    return {"model": loaded.key, "tokens": out["tokens"]}


def _register_plain(app: Celery, zoo: Path, keep: LruModels | None) -> None:
    dirs = model_dirs(zoo)

    @app.task(name=TASK_NAME, shared=False)  # type: ignore[untyped-decorator]
    def generate_task(model: str, prompt: str, max_new_tokens: int, submitted_s: float,
                      i: int) -> dict[str, Any]:
        _threads()
        device = _device()
        # The first token's time from here, load included: what SITS's worker reports.
        with first_token_clock() as clock:
            loaded = keep.get(model) if keep is not None else None
            cold, cold_ms = loaded is None, 0.0
            if loaded is None:
                loaded, cold_ms = load_from_disk(model, dirs[model], device)
                if keep is not None:
                    keep.put(loaded)
            out = _plain_run(loaded, prompt, max_new_tokens)
        return {**out, "cold": cold, "cold_ms": round(cold_ms, 3),
                "source": "disk" if cold else "device", "device": device,
                "first_token_ms": clock.ms}


# -- the SITS side ---------------------------------------------------------------------------

def _register_sits(app: Celery, zoo: Path) -> None:
    for name, path in model_dirs(zoo).items():
        app.register_model(name, path)

    @app.inference_task(name=TASK_NAME, shared=False, ignore_result=True)  # type: ignore[untyped-decorator]
    def generate_task(engine: Any, prompt: str, max_new_tokens: int, submitted_s: float,
                      i: int) -> dict[str, Any]:
        from sits_queue.workers.inference import generate

        out = generate(engine, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)
        return {"model": engine.key, "tokens": out["tokens"],
                "prompt_tokens": out["prompt_tokens"], "cached_tokens": out["cached_tokens"]}


# -- the record every task leaves ----------------------------------------------------------

def record(retval: Any, kwargs: dict[str, Any], started_s: float | None,
           finished_s: float) -> dict[str, Any]:
    """One task's JSON record, from what the task returned (plain or SITS-wrapped)."""
    base = {"i": kwargs.get("i"), "sub": kwargs.get("submitted_s"), "start": started_s,
            "fin": finished_s}
    if isinstance(retval, BaseException) or not isinstance(retval, dict):
        return {**base, "error": f"{type(retval).__name__}: {retval}"}
    meta = retval.get("sits")
    if isinstance(meta, dict):  # SITS: ColdStart's phases, as the result metadata has them
        out = retval["output"]
        cold_ms = sum(float(meta[k]) for k in COLD_PHASES)
        return {**base, "model": out["model"], "cold": bool(meta["cold"]),
                "cold_ms": round(cold_ms, 3), "source": meta["source"],
                "device": meta["device"], "first_token_ms": meta.get("first_token_ms"),
                "prompt_tokens": out.get("prompt_tokens", 0),
                "cached_tokens": out.get("cached_tokens", 0)}
    return {**base, **{k: retval[k] for k in ("model", "cold", "cold_ms", "source",
                                              "device", "first_token_ms")}}


def _connect_records(app: Celery, url: str) -> None:
    clients: dict[int, redis.Redis] = {}
    started: dict[str, float] = {}

    def on_prerun(task_id: str = "", task: Any = None, **_: Any) -> None:
        if getattr(task, "app", None) is app and task.name == TASK_NAME:
            started[task_id] = time.time()

    def on_postrun(task_id: str = "", task: Any = None, kwargs: Any = None,
                   retval: Any = None, **_: Any) -> None:
        if getattr(task, "app", None) is not app or task.name != TASK_NAME:
            return
        rec = record(retval, dict(kwargs or {}), started.pop(task_id, None), time.time())
        rec["host"] = getattr(task.request, "hostname", None)  # which worker served it
        rec["affinity"] = bool(getattr(task.request, AFFINITY_HEADER, False))
        pid = os.getpid()  # a forked child must not reuse its parent's socket
        rec["pid"] = pid  # which pool child (each keeps its own cache)
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(url)
        clients[pid].rpush(DONE_KEY, json.dumps(rec))

    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)


def build(system: str, url: str, zoo: Path, budget_bytes: int,
          settings: Mapping[str, Any] | None = None) -> Celery:
    """The app of ``system`` on database ``url``, its task registered; SITS with these
    ``SitsConfig`` settings, else the defaults."""
    app: Celery
    if system == "sits":
        config = replace(SitsConfig(redis_url=url), **dict(settings or {}))
        app = make_app(config, main="bench_coldstart_sits")
        _register_sits(app, zoo)
    elif system in ("celery_load_per_task", "celery_lru"):
        app = Celery(f"bench_{system}", broker=url)  # stock settings, on purpose
        app.conf.task_ignore_result = True
        _register_plain(app, zoo, LruModels(budget_bytes) if system == "celery_lru" else None)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    _connect_records(app, url)
    return app


def submit(app: Celery, system: str, model: str, prompt: str, max_new_tokens: int, i: int,
           producer: Any, **sits_options: Any) -> None:
    """Send one request the way a user of that system would (SITS: with these options
    besides the model and class)."""
    kwargs = {"submitted_s": time.time(), "i": i}
    task = app.tasks[TASK_NAME]
    if system == "sits":
        task.apply_async((prompt, max_new_tokens), kwargs, model=model, sla_class=SITS_CLASS,
                         producer=producer, **sits_options)
    else:
        task.apply_async((model, prompt, max_new_tokens), kwargs, producer=producer)


_system = os.environ.get(ENV_SYSTEM)
if _system:
    app = build(_system, os.environ[ENV_URL], Path(os.environ[ENV_ZOO]),
                int(os.environ[ENV_BUDGET]), json.loads(os.environ.get(ENV_SETTINGS) or "{}"))
