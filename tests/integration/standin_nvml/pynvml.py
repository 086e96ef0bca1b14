"""A stand-in for nvidia-ml-py's ``pynvml``: the GPUs the JSON file ``$SITS_TEST_NVML``
describes (``{"gpus": [{"uuid", "name", "total", "free"}]}``, bytes), read anew at each
call, so that a test changes a device's free memory while a worker runs.

For the multi-GPU paths a CPU machine cannot show otherwise: a worker started with this
directory first on ``PYTHONPATH`` discovers those GPUs, pins one pool child to each by
UUID (``CUDA_VISIBLE_DEVICES``), and reads their memory here, main process and children
alike. Calls it lacks (utilisation, topology, MIG) are ``AttributeError``s, which the
worker takes as "unsupported on this device", as with an older binding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


def _gpus() -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads(
        Path(os.environ["SITS_TEST_NVML"]).read_text())["gpus"]
    return gpus


def nvmlInit() -> None:
    _gpus()  # (a missing file fails here, as a missing driver fails NVML's init)


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < len(_gpus()):
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> int:
    wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
    for index, gpu in enumerate(_gpus()):
        if gpu["uuid"] == wanted:
            return index
    raise NVMLError("Not Found")


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpus()[handle]["name"])


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_gpus()[handle]["uuid"])


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    gpu = _gpus()[handle]
    return SimpleNamespace(total=gpu["total"], free=gpu["free"], used=gpu["total"] - gpu["free"])
