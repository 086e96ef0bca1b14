"""Roofline placement (MISSION §3.1) in a real fleet of two ``celery worker``s on unlike
GPUs: memory-bound tasks go to the worker with the most bandwidth per FLOP, compute-bound
ones to the worker with the most FLOPs per byte.

This machine has no GPU: each worker runs with the stand-in ``pynvml``
(``standin_nvml/pynvml.py``), one an H200 (ridge ~206 FLOP/byte at fp16), one an L4
(~403). All else is real: discovery, the datasheet figures, the advertisements, each
worker's reading of its fleet, ``pick.lua``, the pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from sits_queue.procs import CeleryProcess, intake_held, start_worker, wait_ready
from sits_queue.workers import advertise
from sits_queue.workers.limits import BYTES_PER_GIB as GIB
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.waiting import wait_for

STANDIN = Path(__file__).parent / "standin_nvml"
H200 = "GPU-a2000000-0000-0000-0000-000000000000"
L4 = "GPU-b4000000-0000-0000-0000-000000000000"
#: Tasks of each kind: a decode step's intensity (memory-bound on both parts) and a long
#: prefill's (compute-bound on both).
EACH = 30
DECODE_FLOP_PER_BYTE = 8.0
PREFILL_FLOP_PER_BYTE = 4000.0


def gpu_worker(tmp_path: Path, redis_url: str, uuid: str, name: str, total_gib: int,
               queues: str | None = None) -> CeleryProcess:
    """A worker of one child whose NVML reports one GPU ``name``."""
    home = tmp_path / uuid[:8]
    home.mkdir()
    state = home / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"uuid": uuid, "name": name,
                                           "total": total_gib * GIB,
                                           "free": (total_gib - 2) * GIB}]}))
    env = worker_env(redis_url)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT), os.environ.get(
        "PYTHONPATH", "")])
    env["SITS_TEST_NVML"] = str(state)
    return start_worker(APP_MODULE, env, home, concurrency=1, cwd=ROOT, queues=queues)


def bounds(r: redis.Redis) -> dict[str, set[str]]:
    """Each worker's roofline weights as its advertisement says, by its GPU's UUID."""
    return {w["devices"][0]["uuid"]: set(w.get("placement", {}).get("bounds", {}))
            for w in advertise.read_workers(r)}


@pytest.fixture
def fleet(tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery
          ) -> Iterator[list[CeleryProcess]]:
    procs = [gpu_worker(tmp_path, redis_url, H200, "NVIDIA H200", 141),
             gpu_worker(tmp_path, redis_url, L4, "NVIDIA L4", 24)]
    try:
        wait_ready(client_app, procs)
        yield procs
    finally:
        for proc in procs:
            proc.stop(timeout_s=10)


def test_memory_bound_work_goes_to_the_bandwidth_rich_gpu_and_compute_bound_to_the_other(
        fleet: list[CeleryProcess], client_app: Celery, r: redis.Redis) -> None:
    # Given each worker has read its fleet (its advertisement says what its picks weigh)
    wait_for(lambda: "memory@fp16" in bounds(r).get(H200, ())
             and "compute@fp16" in bounds(r).get(L4, ()), 30, "each worker to weigh its bound")
    device = client_app.tasks["w.device"]
    # When decode-like and prefill-like tasks wait interleaved, all at once, at one
    # priority (an entropy given: measured, the two tags' would order them apart)
    with intake_held(client_app, fleet):
        for _ in range(EACH):
            device.apply_async(("decode", 0.05), arithmetic_intensity=DECODE_FLOP_PER_BYTE,
                               input_entropy=0.5)
            device.apply_async(("prefill", 0.05), arithmetic_intensity=PREFILL_FLOP_PER_BYTE,
                               input_entropy=0.5)
    wait_for(lambda: r.llen("test:device:decode") + r.llen("test:device:prefill")
             == 2 * EACH, 60, "every task to run")
    # Then each kind ran on the GPU richer in what bounds it (the pinned child's device
    # says which worker ran it); by priority order alone, each GPU would get half of each
    decode = [d.decode() for d in r.lrange("test:device:decode", 0, -1)]
    prefill = [d.decode() for d in r.lrange("test:device:prefill", 0, -1)]
    assert decode.count(H200) >= 0.8 * EACH, (decode.count(H200), decode.count(L4))
    assert prefill.count(L4) >= 0.8 * EACH, (prefill.count(L4), prefill.count(H200))
    # And both GPUs worked: placement reorders the queue, it does not idle a device
    assert {*decode, *prefill} == {H200, L4}


def test_workers_behind_other_queues_are_not_weighed_against_each_other(
        tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery) -> None:
    # Given an H200 on one queue and an L4 on another, each advertising its queues
    procs = [gpu_worker(tmp_path, redis_url, H200, "NVIDIA H200", 141, queues="decode"),
             gpu_worker(tmp_path, redis_url, L4, "NVIDIA L4", 24, queues="encode")]
    try:
        wait_ready(client_app, procs)
        h200, l4 = (p.hostname for p in procs)
        def said() -> dict[str, object]:
            return {w["hostname"]: w.get("queues") for w in advertise.read_workers(r)}

        wait_for(lambda: said() == {h200: ["decode"], l4: ["encode"]}, 30,
                 "each to advertise its queues", seen=said)
        # When the L4's worker also takes the H200's queue (remote control), both weigh
        # their bounds, the H200's too: its peers moved, it did not
        client_app.control.add_consumer("decode", destination=[l4], reply=True)
        wait_for(lambda: "memory@fp16" in bounds(r).get(H200, ())
                 and "compute@fp16" in bounds(r).get(L4, ()), 30, "both to weigh their bound",
                 seen=lambda: bounds(r))
        # Then, the L4 back on its own queue alone, neither weighs one: nothing they
        # compete for (counted as one fleet, each went on weighing the other)
        client_app.control.cancel_consumer("decode", destination=[l4], reply=True)
        wait_for(lambda: bounds(r) == {H200: set(), L4: set()}, 30,
                 "the weights to go with the shared queue", seen=lambda: bounds(r))
    finally:
        for proc in procs:
            proc.stop(timeout_s=10)


def host_worker(tmp_path: Path, redis_url: str, gpus: list[tuple[str, str, int]]
                ) -> CeleryProcess:
    """A worker of one child per GPU of ``gpus`` (UUID, name, GiB) on one stand-in host."""
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [
        {"uuid": uuid, "name": name, "total": gib * GIB, "free": (gib - 2) * GIB}
        for uuid, name, gib in gpus]}))
    env = worker_env(redis_url)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT), os.environ.get(
        "PYTHONPATH", "")])
    env["SITS_TEST_NVML"] = str(state)
    return start_worker(APP_MODULE, env, tmp_path, concurrency=len(gpus), cwd=ROOT)


def device_weights(r: redis.Redis, kind: str) -> dict[str, set[str]]:
    """The one worker's per-device placement weights of ``kind`` (``bounds``,
    ``precisions``) as its advertisement says, by UUID."""
    placement = advertise.read_workers(r)[0].get("placement", {})
    return {u: set(d.get(kind, {})) for u, d in placement.get("devices", {}).items()}


A100 = "GPU-a1000000-0000-0000-0000-000000000000"
T4 = "GPU-t4000000-0000-0000-0000-000000000000"
#: Hosts of unlike GPUs: (UUID, name, GiB) each; the placement weights each device must
#: show (kind, UUID -> a weight's key); and each kind of task's options and the GPU it
#: should run on.
UNLIKE_HOSTS = {
    # (MISSION §3.1; weighed by its best device, the H200's, each freed child pulled
    # memory-bound work alike: measured, half of each kind on each GPU)
    "roofline": ([(H200, "NVIDIA H200", 141), (L4, "NVIDIA L4", 24)],
                 "bounds", {H200: "memory@fp16", L4: "compute@fp16"},
                 {"decode": ({"arithmetic_intensity": DECODE_FLOP_PER_BYTE}, H200),
                  "prefill": ({"arithmetic_intensity": PREFILL_FLOP_PER_BYTE}, L4)}),
    # (§3.2; the pool wrote bf16 tasks to whichever child was idle, the T4's, which has
    # no bf16, as well: 18-22 of 30 on the A100)
    "precision": ([(A100, "NVIDIA A100-SXM4-80GB", 80), (T4, "Tesla T4", 16)],
                  "precisions", {A100: "bf16", T4: "fp32"},
                  {"bf16": ({"precision": "bf16"}, A100),
                   "fp32": ({"precision": "fp32"}, T4)}),
}


@pytest.mark.parametrize("host", sorted(UNLIKE_HOSTS))
def test_on_a_host_of_unlike_gpus_each_child_takes_the_work_its_gpu_suits(
        tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery, host: str
        ) -> None:
    gpus, kind, weights, tasks = UNLIKE_HOSTS[host]
    # Given one worker of two children on one host of two kinds of GPU (one fleet alone)
    r.delete(*(f"test:device:{name}" for name in tasks))  # (the module's earlier tests')
    proc = host_worker(tmp_path, redis_url, gpus)
    try:
        wait_ready(client_app, [proc])
        # each device weighed on its own
        wait_for(lambda: all(w in device_weights(r, kind).get(u, ()) for u, w in
                             weights.items()), 30, "each device to weigh its own",
                 seen=lambda: device_weights(r, kind))
        device = client_app.tasks["w.device"]
        with intake_held(client_app, [proc]):
            for _ in range(EACH):
                for name, (options, _) in tasks.items():
                    device.apply_async((name, 0.05), input_entropy=0.5, **options)
        wait_for(lambda: sum(r.llen(f"test:device:{name}") for name in tasks)
                 == len(tasks) * EACH, 60, "every task to run")
    finally:
        proc.stop(timeout_s=10)
    # Then each kind ran mostly on the GPU that suits it (the pinned child's
    # CUDA_VISIBLE_DEVICES says which), and both GPUs worked
    ran = {name: [d.decode() for d in r.lrange(f"test:device:{name}", 0, -1)]
           for name in tasks}
    for name, (_, gpu) in tasks.items():
        assert ran[name].count(gpu) >= 0.8 * EACH, (name, ran[name].count(gpu))
    assert {d for where in ran.values() for d in where} == {u for u, _, _ in gpus}
