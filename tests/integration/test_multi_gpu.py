"""A worker of two GPUs, as NVML reports them, in a real ``celery worker``: each child
pinned to its own GPU, and a declared ``vram_gib`` checked against the device of the
child that got the task, not only the worker's roomiest.

This machine has no GPU: the worker runs with a stand-in ``pynvml`` first on its path
(``standin_nvml/pynvml.py``), two H100s whose free memory the test sets in a file. All
else is real: discovery, pinning, admission in the main process, the pool, the broker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from sits_queue.broker.keys import QueueKeys
from sits_queue.procs import CeleryProcess, intake_held, start_worker, wait_ready
from sits_queue.workers.advertise import worker_key
from sits_queue.workers.limits import BYTES_PER_GIB as GIB
from tests.integration.conftest import APP_MODULE, ROOT, worker_env
from tests.waiting import wait_for

STANDIN = Path(__file__).parent / "standin_nvml"
UUIDS = ("GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-0000-0000-0000-000000000000")
WAITING = QueueKeys.for_queue("celery")


#: A host of mixed sizes: GPU 0 an 80 GB H100, GPU 1 a 40 GB A100.
MIXED = {UUIDS[0]: ("NVIDIA H100 80GB HBM3", 80), UUIDS[1]: ("NVIDIA A100-SXM4-40GB", 40)}


def set_free(state: Path, free_gib: dict[str, float],
             models: dict[str, tuple[str, int]] | None = None) -> None:
    """The GPUs of ``models`` (uuid -> name, total GiB; two H100s by default) with
    ``free_gib`` free."""
    models = models or dict.fromkeys(UUIDS, ("NVIDIA H100 80GB HBM3", 80))
    gpus = [{"uuid": u, "name": name, "total": total * GIB, "free": int(free_gib[u] * GIB)}
            for u, (name, total) in models.items()]
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(state)  # (read at each NVML call: never half-written)


def standin_worker(tmp_path: Path, redis_url: str, client_app: Celery,
                   **start: Any) -> tuple[CeleryProcess, Path]:
    """A ready worker (``start_worker``'s arguments) whose NVML is the stand-in reading
    ``tmp_path/nvml.json``, which the caller has written."""
    state = tmp_path / "nvml.json"
    env = worker_env(redis_url)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT), os.environ.get(
        "PYTHONPATH", "")])
    env["SITS_TEST_NVML"] = str(state)
    proc = start_worker(APP_MODULE, env, tmp_path, cwd=ROOT, **start)
    try:
        wait_ready(client_app, [proc])
    except BaseException:
        proc.stop(timeout_s=10)
        raise
    return proc, state


@pytest.fixture
def two_gpus(tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery
             ) -> Iterator[tuple[CeleryProcess, Path]]:
    set_free(tmp_path / "nvml.json", dict.fromkeys(UUIDS, 70))
    proc, state = standin_worker(tmp_path, redis_url, client_app, concurrency=2)
    try:
        yield proc, state
    finally:
        proc.stop(timeout_s=10)


@pytest.fixture
def mixed_gpus(tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery
               ) -> Iterator[tuple[CeleryProcess, Path]]:
    set_free(tmp_path / "nvml.json", {UUIDS[0]: 70, UUIDS[1]: 35}, MIXED)
    proc, state = standin_worker(tmp_path, redis_url, client_app, concurrency=2)
    try:
        yield proc, state
    finally:
        proc.stop(timeout_s=10)


def test_each_child_is_pinned_to_its_own_gpu(two_gpus: tuple[CeleryProcess, Path]) -> None:
    proc, _ = two_gpus
    wait_for(lambda: proc.log().count("pinned to NVIDIA H100") == 2, 30, "both children")
    log = proc.log()
    assert all(f"pinned to NVIDIA H100 80GB HBM3 ({u})" in log for u in UUIDS), log[-3000:]


def test_a_task_goes_to_the_child_whose_device_can_hold_it(
        two_gpus: tuple[CeleryProcess, Path], client_app: Celery, r: redis.Redis) -> None:
    proc, state = two_gpus
    device = client_app.tasks["w.device"]
    # Given one child busy for a few seconds: the other is the only idle one
    busy = device.apply_async(("busy", 4.0))
    wait_for(lambda: r.llen("test:device:busy") == 1, 30, "the busy task to start")
    roomy = r.lindex("test:device:busy", 0).decode()
    full = next(u for u in UUIDS if u != roomy)
    # and the idle child's GPU nearly full, the busy one's roomy (the main process
    # admits by the roomiest device: 70 GiB free)
    set_free(state, {roomy: 70, full: 5})
    big = device.apply_async(("big",), vram_gib=40)
    # Then the idle child, on the full GPU, gives it back, uncounted, naming its device
    wait_for(lambda: f"[{big.id}] not started here: declares vram_gib=40 but this "
             f"child's device" in proc.log(), 30, "the idle child to give it back")
    assert f"({full}) has 5.00 GiB free" in proc.log()
    # and it runs on the roomy GPU once that child is free, never on the full one
    assert big.get(timeout=30) == roomy
    assert busy.get(timeout=10) == roomy
    assert [d.decode() for d in r.lrange("test:device:big", 0, -1)] == [roomy]
    assert r.hlen(WAITING.redelivered) == 0 and r.hlen(WAITING.dead) == 0
    # And a task that fits either device runs on whichever child is idle
    set_free(state, dict.fromkeys(UUIDS, 70))
    assert device.apply_async(("any",), vram_gib=40).get(timeout=30) in UUIDS
    assert proc.alive()


def test_a_batch_the_idle_childs_device_cannot_hold_goes_back_whole(
        two_gpus: tuple[CeleryProcess, Path], client_app: Celery, r: redis.Redis) -> None:
    """(a batch's calls were checked in the main process only, by the roomiest device:
    the pool child on a full GPU ran them)"""
    proc, state = two_gpus
    device = client_app.tasks["w.device"]
    # Given one child busy for a few seconds, the idle one's GPU nearly full
    busy = device.apply_async(("busy", 8.0))  # (past the hold's control round trips)
    wait_for(lambda: r.llen("test:device:busy") == 1, 30, "the busy task to start")
    roomy = r.lindex("test:device:busy", 0).decode()
    full = next(u for u in UUIDS if u != roomy)
    set_free(state, {roomy: 70, full: 5})
    # When three batch calls declaring 40 GiB wait together (taken as one batch)
    batch = client_app.tasks["w.batch_device"]
    with intake_held(client_app, [proc]):
        calls = [batch.apply_async((f"b{n}",), vram_gib=40) for n in range(3)]
    # Then the idle child gives the whole batch back, uncounted, naming its device, and
    # the batch goes back as one (under one hold: it comes back whole)
    wait_for(lambda: f"({full}) has 5.00 GiB free" in proc.log(), 30,
             "the idle child to give the batch back")
    assert "batch of 3 w.batch_device tasks" in proc.log()
    # and the calls run on the roomy GPU once its child is free, never on the full one
    done = [c.get(timeout=30) for c in calls]
    assert [d["output"] for d in done] == [roomy] * 3
    assert [d["sits"]["batch"]["size"] for d in done] == [3] * 3  # (one batch, again)
    assert busy.get(timeout=10) == roomy
    for n in range(3):
        assert [d.decode().split()[0] for d in r.lrange(f"test:device:b{n}", 0, -1)] \
            == [roomy]
    assert r.hlen(WAITING.redelivered) == 0 and r.hlen(WAITING.dead) == 0
    assert proc.alive()


def test_a_task_that_fits_one_device_goes_to_its_idle_child(
        mixed_gpus: tuple[CeleryProcess, Path], client_app: Celery, r: redis.Redis) -> None:
    proc, state = mixed_gpus
    device = client_app.tasks["w.device"]
    # Given both children idle and a task only the 80 GB GPU can hold (50 GiB; the 40 GB
    # one has 35 free). (The pool handed it to the first idle child in its own order, the
    # 40 GB one here, at every take: given back, taken again, never run)
    for n in range(3):
        assert device.apply_async((f"big{n}",), vram_gib=50).get(timeout=8) == UUIDS[0]
    # And when the big GPU is nearly full, a task that fits only the small one runs there
    set_free(state, {UUIDS[0]: 5, UUIDS[1]: 35}, MIXED)
    for n in range(3):
        assert device.apply_async((f"small{n}",), vram_gib=30).get(timeout=8) == UUIDS[1]
    assert r.hlen(WAITING.redelivered) == 0 and r.hlen(WAITING.dead) == 0
    assert proc.alive()


def test_a_worker_of_fewer_children_than_gpus_admits_and_advertises_theirs_only(
        tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery) -> None:
    # Given a worker of one child on a host whose GPU 0 is 40 GB and GPU 1 80 GB: its
    # child is pinned to GPU 0, and nothing runs on GPU 1
    small_first = {UUIDS[0]: MIXED[UUIDS[1]], UUIDS[1]: MIXED[UUIDS[0]]}
    set_free(tmp_path / "nvml.json", {UUIDS[0]: 35, UUIDS[1]: 70}, small_first)
    proc, _ = standin_worker(tmp_path, redis_url, client_app, concurrency=1)
    try:
        # Then it says so at start, and advertises the device its child uses
        assert "GPU 1 (NVIDIA H100 80GB HBM3" in proc.log() and "no pool child" in proc.log()
        record = json.loads(r.get(f"sits:worker:{proc.hostname}"))
        assert [d["uuid"] for d in record["devices"]] == [UUIDS[0]]
        # And a task only GPU 1 could hold is no task for it (no other worker: it is
        # dead-lettered, not admitted for GPU 1's room and given back by its child for good)
        big = client_app.tasks["w.device"].apply_async(("big",), vram_gib=50)
        with pytest.raises(Exception, match="NoDeviceLargeEnough"):
            big.get(timeout=8)
        assert client_app.tasks["w.device"].apply_async(("fits",), vram_gib=20).get(
            timeout=8) == UUIDS[0]
    finally:
        proc.stop(timeout_s=10)


def test_an_autoscaled_pool_admits_by_the_gpus_of_its_live_children(
        tmp_path: Path, redis_url: str, r: redis.Redis, client_app: Celery) -> None:
    """(planned at its most, two children on two GPUs, it ran one, on the 40 GB GPU, and
    admitted a 50 GiB task for the unforked child's 80 GB GPU: the one child gave it
    back at every take)"""
    small_first = {UUIDS[0]: MIXED[UUIDS[1]], UUIDS[1]: MIXED[UUIDS[0]]}  # 40 GB, 80 GB
    set_free(tmp_path / "nvml.json", {UUIDS[0]: 35, UUIDS[1]: 70}, small_first)
    proc, _ = standin_worker(tmp_path, redis_url, client_app, concurrency=1,
                             extra_args=["--autoscale=2,1"])
    try:
        wait_for(lambda: "pool child 0" in proc.log(), 30, "the first child")
        # When a task only the unforked child's GPU could hold arrives
        big = client_app.tasks["w.device"].apply_async(("big",), vram_gib=50)
        # Then the worker refuses it itself (its one child's GPU is all it weighs), not
        # the child after the pool handed it over
        wait_for(lambda: f"[{big.id}] not started here" in proc.log(), 30, "the refusal")
        log = proc.log()
        assert "this child's device" not in log, log[-3000:]
        # and its advertisement names the GPU of its live child only
        worker = json.loads(r.get(worker_key("", proc.hostname)) or "{}")
        assert [d["uuid"] for d in worker["devices"]] == [UUIDS[0]]
        # while a task the live child's GPU holds runs there
        assert client_app.tasks["w.device"].apply_async(("fits",), vram_gib=30).get(
            timeout=30) == UUIDS[0]
        big.revoke()
    finally:
        proc.stop(timeout_s=10)
