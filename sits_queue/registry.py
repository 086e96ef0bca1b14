"""The model registry: names users give models, and how each one is loaded.

``@app.model("name")`` registers a zero-argument loader that returns an engine
(:class:`sits_queue.cache.engines.Engine`), a ``torch.nn.Module``, or a path: a Hugging
Face model directory, or an engine file (``.onnx``, ``.pt2``, ``.plan``/``.engine``:
``engines.engine_from_path``); ``app.register_model("name", path)`` registers a path
directly. Loaders run lazily, inside a pool child, the first time a task needs the model
and again whenever the warm cache dropped it, so they must be cheap to call twice and
must not touch CUDA at import time.

Each call must build a **new** model: the cache releases the engine it drops (and a
precision conversion the engine it converted), so a loader memoised with
``functools.cache`` would hand back a released engine. The cache refuses one that was
released, or that it already holds for another model, with a ``ModelLoadError`` saying
so, rather than serve it, and a memoised ``nn.Module`` once it holds it under another
key ("m" and "m@fp32" would share its weights); alone, it is served, but its weights
then outlive the engine, in memory the cache counts as freed. Memoise what is costly to
read (a state dict in host memory) and build the module from it in each call.

Importing this module imports neither torch nor the engine backends.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sits_queue.errors import ModelLoadError, UnknownModel, missing_extra

#: What a loader may return: an Engine, an nn.Module, or a path (directory or engine file).
Loader = Callable[[], Any]
#: Model names travel in message headers and Redis keys: keep them printable and short.
#: No "@": it separates a model from its precision in engine keys ("lm@fp16").
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,199}$")


@dataclass(frozen=True)
class ModelSpec:
    """One registered model."""

    name: str
    loader: Loader
    #: Example inputs for an nn.Module's warm-up call (``module(*sample_inputs)``).
    sample_inputs: tuple[Any, ...] | None = None


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"model name must be 1-200 printable characters without spaces "
                         f"or '@' (it names a precision: 'lm@fp16'), got {name!r}")
    return name


class ModelRegistry:
    """Name -> :class:`ModelSpec`. Registration is thread-safe; lookups are plain reads."""

    def __init__(self) -> None:
        self._specs: dict[str, ModelSpec] = {}
        self._lock = threading.Lock()

    def register(self, name: str, loader: Loader | str | os.PathLike[str], *,
                 sample_inputs: tuple[Any, ...] | None = None,
                 replace: bool = False) -> ModelSpec:
        """Register ``loader`` (or a path: a model directory or an engine file) under
        ``name``.

        Registering a name twice raises unless ``replace``: two modules silently
        fighting over one name would serve one of them to every task.
        """
        _check_name(name)
        if isinstance(loader, (str, os.PathLike)):
            loader = _path_loader(Path(loader))
        if not callable(loader):
            raise TypeError(f"loader for model {name!r} must be callable or a path, "
                            f"got {type(loader).__name__}")
        spec = ModelSpec(name=name, loader=loader, sample_inputs=sample_inputs)
        with self._lock:
            held = self._specs.get(name)
            if held is not None and not replace:
                if not _same_registration(held, spec):
                    raise ValueError(f"model {name!r} is already registered (with another "
                                     "loader or sample inputs of another shape); pass "
                                     "replace=True")
                return held  # the same again (a module imported twice): nothing changes
            self._specs[name] = spec
        return spec

    def get(self, name: str) -> ModelSpec:
        """The spec for ``name``; :class:`UnknownModel` naming the known ones otherwise."""
        spec = self._specs.get(name)
        if spec is None:
            known = ", ".join(sorted(self._specs)) or "none"
            raise UnknownModel(f"no model named {name!r} is registered on this worker "
                               f"(known: {known})")
        return spec

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._specs))

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._specs)


@dataclass(frozen=True)
class _PathLoader:
    """A registered path's loader: equal to another of the same path."""

    path: Path

    def __call__(self) -> Path:
        return self.path


def _path_loader(path: Path) -> Loader:
    """Made absolute at registration (the place meant is the one beside the registering
    code's working directory, whatever a worker's is when it loads) and written plainly,
    so that the same place registered again is the same registration
    (``models/../models/lm``, ``./models/lm`` and ``models/lm`` were three)."""
    return _PathLoader(Path(os.path.abspath(path)))


def _same_registration(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether ``b`` registers what ``a`` did: as a module imported twice (``__main__``
    and by its name, a worker's ``-A`` and an import) does, with new function objects
    from the same source, and sample tensors drawn again (``torch.randn``): a loader of
    the same code at the same place, samples of the same structure, shapes and dtypes.
    (Compared as dataclasses, a re-imported loader always differed, and sample tensors
    raised "Boolean value of Tensor ... is ambiguous".)"""
    return _same_loader(a.loader, b.loader) and _same_sample(a.sample_inputs, b.sample_inputs)


def _same_loader(a: Loader, b: Loader) -> bool:
    """Whether two loaders are one registration made twice (a module imported twice):
    the same code, and the same values it closes over or defaults to (a factory's
    loaders for two paths share their code: the second was taken for the first, and
    every task served the first model); a ``functools.partial`` by its function and
    arguments."""
    if a is b or (isinstance(a, _PathLoader) and a == b):
        return True
    if isinstance(a, functools.partial) or isinstance(b, functools.partial):
        return (isinstance(a, functools.partial) and isinstance(b, functools.partial)
                and _same_loader(a.func, b.func) and _same_values(a.args, b.args)
                and _same_values(a.keywords, b.keywords))
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_b is None:
        return False
    return (getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
            and code_a.co_filename == code_b.co_filename
            and code_a.co_firstlineno == code_b.co_firstlineno
            and code_a.co_code == code_b.co_code and code_a.co_consts == code_b.co_consts
            and _same_values(_cells(a), _cells(b))
            and _same_values(getattr(a, "__defaults__", None),
                             getattr(b, "__defaults__", None))
            and _same_values(getattr(a, "__kwdefaults__", None),
                             getattr(b, "__kwdefaults__", None)))


def _cells(loader: Any) -> tuple[Any, ...]:
    """The values a function closes over (an empty cell: a marker of its own)."""
    out = []
    for cell in getattr(loader, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            out.append(_EMPTY_CELL)
    return tuple(out)


#: An empty closure cell's value in :func:`_cells`.
_EMPTY_CELL = object()


def _alike(a: Any, b: Any, leaf: Callable[[Any, Any], bool]) -> bool:
    """Whether ``a`` and ``b`` have one structure (tuples, lists and dicts of the same
    types, lengths and keys) whose leaves ``leaf`` finds alike."""
    if isinstance(a, tuple | list) or isinstance(b, tuple | list):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_alike(x, y, leaf) for x, y in zip(a, b, strict=True)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_alike(a[k], b[k], leaf) for k in a))
    return leaf(a, b)


def _same_values(a: Any, b: Any) -> bool:
    """Loader arguments alike: equal values, or the same object where a value has no
    plain equality (a model object, an array), loaders compared as loaders."""
    return _alike(a, b, _same_value)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if callable(a) and callable(b):
        return _same_loader(a, b)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose comparison is not a truth value
        return False


def _same_sample(a: Any, b: Any) -> bool:
    """Sample inputs alike: tensors and arrays by type, shape and dtype (drawn again,
    their values differ), other values by equality."""
    return _alike(a, b, _same_sample_leaf)


def _same_sample_leaf(a: Any, b: Any) -> bool:
    shape_a, shape_b = getattr(a, "shape", None), getattr(b, "shape", None)
    if shape_a is not None or shape_b is not None:  # tensors, arrays: not by value
        return (type(a) is type(b) and tuple(shape_a or ()) == tuple(shape_b or ())
                and getattr(a, "dtype", None) == getattr(b, "dtype", None))
    try:
        return bool(a == b)
    except Exception:  # a value whose comparison is not a truth value
        return a is b


def load_engine(spec: ModelSpec, device: str) -> Any:
    """Run the loader and wrap what it returns in an Engine (``cache.engines``).

    A loader that raises, or returns something that is not a model, becomes
    :class:`ModelLoadError` naming the model; the cause stays chained for the log.
    Device out-of-memory errors pass through unchanged so the caller can map them to
    ``VramLimitExceeded``, and so does the task's soft time limit firing mid-load: the
    task ran out of time, the model is not broken.
    """
    from celery.exceptions import SoftTimeLimitExceeded

    from sits_queue.workers import gpu

    try:
        produced = spec.loader()
        return as_engine(spec, produced, device)
    except (ModelLoadError, SoftTimeLimitExceeded):
        raise
    except Exception as exc:
        if gpu.is_oom(exc):
            raise
        hint = missing_extra(exc)
        raise ModelLoadError(f"loader for model {spec.name!r} failed: "
                             f"{type(exc).__name__}: {exc}"
                             + (f" (the inference extra: {hint})" if hint else "")) from exc
    except (SystemExit, KeyboardInterrupt) as exc:
        # The loader's own (a pool child ignores SIGINT): let through, it ended the child
        # at every redelivery, and the task was dead-lettered as poison with no word of
        # the loader. The worker's own way out goes on (a revoke(terminate=True) that
        # came mid-load: converted, the child lived on and the load was called failed)
        from sits_queue.exits import worker_exit

        if worker_exit(exc):
            raise
        raise ModelLoadError(f"loader for model {spec.name!r} tried to end its process "
                             f"({type(exc).__name__}: {exc}); a loader that fails must "
                             "raise an Exception") from exc


def as_engine(spec: ModelSpec, produced: Any, device: str) -> Any:
    """Engine for a loader's result: an Engine as is, a module wrapped, a path loaded."""
    from sits_queue.cache import engines
    from sits_queue.cache.contract import Engine

    if isinstance(produced, Engine):
        # Served as the model it was registered as: the child's embedding cache, its
        # KV-prefix store and its precision copies go by the engine's key, and two
        # models whose loaders built engines under one name ("encoder") shared them.
        produced.key = spec.name
        return produced
    if isinstance(produced, (str, os.PathLike)):
        path = Path(produced)
        if not path.exists():
            raise ModelLoadError(f"model {spec.name!r}: nothing at {path}")
        if not path.is_dir() and path.suffix.lower() not in engines.ENGINE_FILES:
            raise ModelLoadError(f"model {spec.name!r}: {path} is neither a model directory "
                                 f"nor an engine file ({', '.join(engines.ENGINE_FILES)})")
        return engines.engine_from_path(spec.name, path, device)
    import torch

    if isinstance(produced, torch.nn.Module):
        return engines.TorchEngine(spec.name, produced, spec.sample_inputs)
    raise ModelLoadError(f"loader for model {spec.name!r} returned "
                         f"{type(produced).__name__}; expected an Engine, a torch.nn.Module "
                         f"or a model directory path")
