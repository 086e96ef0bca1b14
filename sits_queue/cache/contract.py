"""The engine contract: what the warm cache holds, whatever the backend (STYLE habit 8).

An :class:`Engine` is a runnable model that lives in one of two tiers (MISSION §4.3):

* ``host``: its weights (or serialized artefact) sit in host memory; nothing on the device.
  Every engine starts here: building one reads the disk once, and never again.
* ``device``: it is ready to run on ``device`` ("cuda:0", or "cpu" on a CPU host, where
  the moves are no-ops but are still timed so the accounting has the same shape).

``to_device``/``to_host``/``warmup`` return the milliseconds they took, for the cold-start
accounting of MISSION §4.1. Each backend overrides only the primitives (``_promote``,
``_demote``, ``_run``, ``_release``, ``size_bytes``); the base class owns the tier
bookkeeping, the timing and the checks, as kombu's virtual transport does for its
channels (STYLE habit 5). The backends are in :mod:`sits_queue.cache.engines`.

torch is imported inside functions only: this module is imported by the worker's parent
process, which must never start CUDA (STYLE habit 6).
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from sits_queue.cache.policy import Tier
from sits_queue.errors import SitsError

if TYPE_CHECKING:
    import torch

Backend = Literal["torch", "torch_export", "aoti", "onnxruntime", "tensorrt"]
#: Positional arguments (a tuple) or keyword arguments (a mapping) for one call.
Inputs = tuple[Any, ...] | Mapping[str, Any]
#: ``(shape, dtype name)`` per positional tensor input: enough to synthesise a warm-up input.
InputSpec = list[tuple[list[int], str]]


class EngineError(SitsError, RuntimeError):
    """An engine was used in a way its state does not allow."""


class EngineReleased(EngineError):
    """The engine was released; build a new one."""


class EngineNotResident(EngineError):
    """The engine is in the host tier: promote it with ``to_device`` before running it."""


class EngineFormatError(SitsError, ValueError):
    """A path holds no engine format this module knows, or one the device cannot run."""


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _synchronize(device: str | None) -> None:
    """Wait for queued GPU work, so a timing covers the work and not just its launch."""
    if device is not None and device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def device_index(device: str) -> int:
    return int(device.partition(":")[2] or 0) if is_cuda(device) else -1


def _split(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return tuple(inputs), {}


def map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (through tuples, lists, dicts)."""
    torch = sys.modules.get("torch")
    if torch is None:  # no tensor can exist before torch is imported: nothing to map
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def move(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor in it moved to ``device``."""
    return map_tensors(obj, lambda t: t.to(device))


def input_spec(args: Sequence[Any]) -> InputSpec:
    """The shape and dtype of each positional tensor in ``args``."""
    return [(list(a.shape), str(a.dtype).removeprefix("torch.")) for a in args]


def synthesize(spec: InputSpec, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic inputs matching ``spec``: normal floats, zero integers.

    Zeros keep integer inputs (token ids, indices) in range for any vocabulary.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype_name in spec:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
        out.append(t.to(device))
    return tuple(out)


class Engine(ABC):
    """A runnable model in the ``host`` or ``device`` tier; see the module docstring."""

    backend: ClassVar[Backend]
    #: A promotion rebuilds runtime state (a session, an execution context, a loaded
    #: library) whose first run pays one-off setup, so the cache warms it up again.
    rewarm_on_promote: ClassVar[bool] = False
    #: Its device memory comes from torch's caching allocator (False: the backend's own,
    #: which cannot reuse blocks torch keeps cached).
    torch_allocated: ClassVar[bool] = True

    def __init__(self, key: str, sample_inputs: Inputs | None = None,
                 artifacts: Mapping[str, Any] | None = None) -> None:
        if not key:
            raise ValueError("engine key must be non-empty")
        self.key = key
        #: Companions a task needs besides the engine, e.g. ``{"tokenizer": ...}``.
        self.artifacts: dict[str, Any] = dict(artifacts or {})
        self._sample = sample_inputs
        self._device: str | None = None
        self._released = False

    # -- the contract ------------------------------------------------------------------------

    @property
    def tier(self) -> Tier:
        return "host" if self._device is None else "device"

    @property
    def device(self) -> str | None:
        """Where the engine runs now; None in the host tier."""
        return self._device

    @property
    def released(self) -> bool:
        return self._released

    @property
    def sample_inputs(self) -> Inputs | None:
        """The warm-up input the engine was built with (None: it has none)."""
        return self._sample

    @abstractmethod
    def size_bytes(self) -> int:
        """Bytes the engine occupies on the device when promoted (what the budgets count)."""

    def to_device(self, device: str) -> float:
        """Promote to ``device`` (from host memory, never from disk); ms spent."""
        self._live()
        start = time.perf_counter()
        if self._device != device:
            if self._device is not None:
                self._demote()
            if not self.torch_allocated and is_cuda(device):
                # The pool counts a demoted torch engine's bytes free, but torch's
                # allocator keeps them cached for torch alone (with any KV memory held
                # in reserve): hand them back to the driver, for this backend to use.
                _release_torch_cache()
            self._promote(device)
            _synchronize(device)
        self._device = device
        return _ms_since(start)

    def to_host(self) -> float:
        """Demote: free the device copy, keep the weights in host memory; ms spent."""
        self._live()
        start = time.perf_counter()
        if self._device is not None:
            device, self._device = self._device, None
            self._demote()
            _synchronize(device)
        return _ms_since(start)

    def warmup(self) -> float:
        """One inference on a representative sample input; ms spent.

        0.0 for an engine built without a sample input (and none it can derive): nothing
        representative to run, and refusing would turn a working model into a failed load.
        """
        device = self._resident()
        sample = self._warmup_inputs(device)
        if sample is None:
            return 0.0
        start = time.perf_counter()
        self._warm(device, sample)
        _synchronize(device)
        return _ms_since(start)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._resident()
        return self._run(args, kwargs)

    def holds(self) -> object:
        """What owns the engine's memory (the engine itself; a torch engine's module):
        two engines that hold one thing are one model's memory, which moves, and is
        freed, for both."""
        return self

    def release(self) -> None:
        """Free device and host memory; the engine cannot be used afterwards."""
        if self._released:
            return
        device, self._device = self._device, None
        self._released = True
        self._release()
        if device is not None and is_cuda(device):
            import torch

            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        state = "released" if self._released else self.tier
        return f"<{type(self).__name__} {self.key!r} {state} {self.size_bytes()} B>"

    # -- primitives ----------------------------------------------------------------------------

    @abstractmethod
    def _promote(self, device: str) -> None: ...

    @abstractmethod
    def _demote(self) -> None: ...

    @abstractmethod
    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    @abstractmethod
    def _release(self) -> None: ...

    def _warmup_inputs(self, device: str) -> Inputs | None:
        return self._sample

    def _warm(self, device: str, sample: Inputs) -> None:
        """The warm-up itself: one inference on ``sample`` (a backend may do more)."""
        args, kwargs = _split(sample)
        self._run(move(args, device), move(kwargs, device))

    def _live(self) -> None:
        if self._released:
            raise EngineReleased(f"engine {self.key!r} was released")

    def _resident(self) -> str:
        self._live()
        if self._device is None:
            raise EngineNotResident(f"engine {self.key!r} is in the host tier: "
                                    "promote it with to_device() before running it")
        return self._device


def bind_inputs(key: str, names: Sequence[str], args: Sequence[Any],
                kwargs: Mapping[str, Any], backend: str = "TensorRT") -> dict[str, Any]:
    """A call's arguments as the engine's inputs, by name: positional ones in the
    engine's input order, then keywords. Every input given exactly once, no other: an
    input left out would keep the previous call's address in TensorRT (a freed buffer:
    garbage), which drops inputs the network does not use, so they need not be
    ``forward``'s arguments; an extra one was dropped without a word (pure)."""
    if len(args) > len(names):
        raise EngineError(f"{backend} engine {key!r} takes {len(names)} inputs {list(names)}, "
                          f"got {len(args)} positional arguments")
    feed = dict(zip(names, args, strict=False))
    twice = sorted(set(feed) & set(kwargs))
    unknown = sorted(set(kwargs) - set(names))
    if twice or unknown:
        raise EngineError(f"{backend} engine {key!r}: " + "; ".join(
            ([f"inputs {twice} given by position and by name"] if twice else [])
            + ([f"no inputs named {unknown} (its inputs: {list(names)})"] if unknown else [])))
    feed.update(kwargs)
    missing = [n for n in names if n not in feed]
    if missing:
        raise EngineError(f"{backend} engine {key!r}: inputs {missing} not given (its "
                          f"inputs: {list(names)})")
    return feed


def _release_torch_cache() -> None:
    torch = sys.modules.get("torch")  # not imported: nothing cached
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
