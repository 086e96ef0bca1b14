"""The worker runtime on a real NVIDIA GPU (``pytest -m gpu tests/gpu``; ops/gpu_check.sh).

Skipped (by ``tests/conftest.py``) where NVML sees no GPU. CUDA is only ever touched in
subprocesses: the pytest process itself stays CUDA-free, as a worker's parent must, so
each check starts from a fresh process and times a real first context.

Checks: CUDA context timing; the per-process memory fraction turning an over-limit
allocation into an OOM that ``gpu.is_oom`` recognises, and memory coming back after
``release_memory``; then, in a real worker: one child per GPU, each pinned by UUID; the
class VRAM cap failing a task with ``VramLimitExceeded`` while the child keeps serving;
and a hard time-limit kill whose replacement child lands on the same GPU while the
killed child's memory is returned to the device; batches, template prefills, and
generations joining a running batch (continuous batching, on by default with GPUs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from celery import Celery
from celery.exceptions import TimeLimitExceeded
from celery.exceptions import TimeoutError as CeleryTimeoutError

from sits_queue.errors import VramLimitExceeded
from sits_queue.procs import CeleryProcess, wait_ready
from tests.integration.inference_app import (
    ROOT,
    build_models,
    client_app,
    spawn_worker,
    write_config,
)
from tests.stuck import native_stacks
from tests.waiting import wait_for

pytestmark = pytest.mark.gpu

GIB = 2**30
#: First task in a fresh child: imports, CUDA context, model load.
FIRST_CALL_S = 180
#: A replacement child's first task (CUDA context and load after a kill): its hard limit.
REPLACED_CALL_S = 100
#: Past this a first call is stuck rather than slow: the test notes where it waits.
SLOW_FIRST_CALL_S = 45
#: x86-64 system call numbers a stuck thread is most likely in.
SYSCALLS = {"202": "futex (a lock)", "16": "ioctl (the driver)", "7": "poll",
            "0": "read", "23": "select", "232": "epoll_wait"}
#: runtime.init_child's log line: "pool child 1 (pid 42) pinned to NVIDIA H200 (GPU-...)".
PINNED = re.compile(r"pool child (\d+) \(pid \d+\) pinned to .*\((GPU-[^)]+)\)")


def nvml_devices() -> list[dict[str, Any]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                        "used": int(mem.used), "total": int(mem.total)})
        return out
    finally:
        pynvml.nvmlShutdown()


def where_blocked(pid: int) -> str:
    """Where each thread of ``pid`` and its children waits, from /proc: its state, the
    kernel function it sleeps in and its system call (a lock, or the driver)."""
    lines = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for task in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = (task / "wchan").read_text().strip() or "-"
                call = (task / "syscall").read_text().split()[0]
            except (OSError, IndexError) as exc:
                lines.append(f"pid {proc.pid} thread {task.name}: unreadable ({exc})")
                continue
            lines.append(f"pid {proc.pid} thread {task.name}: {state} in {wchan}, "
                         f"syscall {SYSCALLS.get(call, call)}")
    return "\n".join(lines)


def in_fresh_process(code: str) -> Any:
    """Run ``code`` (which prints one JSON line last) in a new interpreter; its answer."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])



# -- in one process ----------------------------------------------------------------------------

def test_cuda_context_is_timed_once() -> None:
    first, second, stats = in_fresh_process(
        "import json; from sits_queue.workers import gpu\n"
        "a = gpu.create_context(); b = gpu.create_context()\n"
        "print(json.dumps([a, b, gpu.memory_stats()]))")
    # MISSION §4.1 puts it at 120-180 ms on an A10G; any real context costs > 1 ms.
    assert first > 1.0
    assert second == 0.0
    assert stats["reserved_bytes"] > 0


def test_a_causal_lms_warm_up_reserves_its_kv_memory_on_the_gpu(tmp_path: Path) -> None:
    from sits_queue.models import tiny

    path = tiny.build_tiny_causal_lm(tmp_path / "lm", seed=0)
    got = in_fresh_process(
        "import json, torch; from sits_queue.cache import kvwarm\n"
        "from sits_queue.cache.engines import engine_from_path\n"
        f"e = engine_from_path('lm', {str(path)!r}, 'cuda:0'); e.to_device('cuda:0')\n"
        "before = torch.cuda.memory_reserved(); ms = e.warmup()\n"
        "want = kvwarm.kv_bytes_per_token(e.module) * kvwarm.reserve_tokens(e.module)\n"
        "print(json.dumps({'ms': ms, 'reserved': e.kv_reserved_bytes, 'want': want,\n"
        "                  'grew': torch.cuda.memory_reserved() - before}))")
    # The KV memory of a long generation is in the allocator's cache, not held by a tensor
    assert got["ms"] > 0 and got["reserved"] == got["want"] > 0
    assert got["grew"] >= got["reserved"]


def test_an_onnx_promotion_gets_the_memory_a_demoted_torch_engine_left_cached(
        tmp_path: Path) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime here has no CUDA provider")
    from sits_queue.models import tiny

    path = tiny.build_tiny_causal_lm(tmp_path / "lm", seed=0)
    got = in_fresh_process(
        "import json, torch; from sits_queue.cache.engines import OnnxEngine, "
        "engine_from_path, export_onnx\n"
        f"e = engine_from_path('lm', {str(path)!r}, 'cuda:0'); e.to_device('cuda:0')\n"
        "e.warmup(); e.to_host(); cached = torch.cuda.memory_reserved()\n"
        f"onnx = export_onnx(torch.nn.Linear(8, 8), (torch.randn(2, 8),), "
        f"{str(tmp_path / 'l.onnx')!r})\n"
        "o = OnnxEngine.load('lin', onnx); o.to_device('cuda:0')\n"
        "print(json.dumps({'cached': cached, 'after': torch.cuda.memory_reserved()}))")
    # the demoted LM's blocks (and its KV reserve) went back to the driver for ONNX Runtime
    assert got["cached"] > 0 and got["after"] < got["cached"]


def test_int8_layers_on_cuda_give_what_they_give_on_the_cpu() -> None:
    """Int8Linear on the GPU (``torch._int_mm``, or its float64 fallback where the CUDA
    kernel refuses a shape): the same int32 sums as on the CPU. Tasks' int8 is still
    served at fp16 on a GPU; this is what would let it run there."""
    got = in_fresh_process(
        "import json, torch; from sits_queue.cache.int8 import Int8Linear, int8_matmul\n"
        "torch.manual_seed(0); out = {}\n"
        "for m, k, n in ((1, 64, 64), (32, 64, 128), (40, 36, 20)):\n"
        "    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)\n"
        "    b = torch.randint(-127, 128, (k, n), dtype=torch.int8)\n"
        "    out[f'{m}x{k}x{n}'] = torch.equal(int8_matmul(a.cuda(), b.cuda()).cpu(),\n"
        "                                      int8_matmul(a, b))\n"
        "layer = Int8Linear(torch.randn(96, 64), torch.randn(96)); x = torch.randn(3, 24, 64)\n"
        "cpu = layer(x); gpu = layer.cuda()(x.cuda()).cpu()\n"
        "out['layer_max_diff'] = float((cpu - gpu).abs().max())\n"
        "print(json.dumps(out))")
    assert got.pop("layer_max_diff") < 1e-5
    assert all(got.values()), got


def test_memory_fraction_turns_overuse_into_a_recognised_oom() -> None:
    result = in_fresh_process(
        "import json, torch; from sits_queue.workers import gpu\n"
        "gpu.create_context(); total = gpu.total_memory_bytes()\n"
        "gpu.cap_memory(2 * 2**30 / total)\n"
        "ok = torch.empty(2**30, dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda'); oom = None\n"
        "except Exception as exc:\n"
        "    oom = gpu.is_oom(exc)\n"
        "held = torch.cuda.memory_allocated(); del ok; gpu.release_memory()\n"
        "print(json.dumps({'oom': oom, 'held': held, 'after': gpu.memory_stats()}))")
    assert result["oom"] is True
    assert result["held"] >= GIB
    assert result["after"]["allocated_bytes"] < 16 * 2**20
    assert result["after"]["reserved_bytes"] < 64 * 2**20


# -- in a real worker --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu")
    return build_models(root / "models"), write_config(root / "sits.toml")


@pytest.fixture(scope="module")
def app(redis_url: str, setup: tuple[Path, Path]) -> Iterator[Celery]:
    client = client_app(redis_url, setup[1], "gpu-client")
    yield client
    client.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
           setup: tuple[Path, Path], app: Celery) -> Iterator[CeleryProcess]:
    models, config = setup
    proc = spawn_worker(redis_url, config, models, tmp_path_factory.mktemp("logs"), name="gpu")
    try:
        wait_ready(app, [proc], timeout_s=120)
        yield proc
    finally:
        proc.stop(timeout_s=30)


def call(app: Celery, name: str, *args: Any, timeout: float = 60, **options: Any) -> Any:
    return app.tasks[name].apply_async(args, **options).get(timeout=timeout)


def test_one_child_per_gpu_pinned_by_uuid(app: Celery, worker: CeleryProcess) -> None:
    gpus = nvml_devices()
    assert len(psutil.Process(worker.pid).children()) == len(gpus)
    first = call(app, "t.describe", "pin", timeout=FIRST_CALL_S)
    second = call(app, "t.describe", "pin-again")
    uuids = {g["uuid"] for g in gpus}
    assert first["output"]["cuda_visible"] in uuids
    assert first["sits"]["device"].startswith("cuda:")
    # The child's first task paid the context, timed apart from the load; the next did not
    assert first["sits"]["cold"] is True
    assert first["sits"]["cuda_ctx_ms"] > 1.0 and first["sits"]["load_ms"] > 0
    assert second["sits"]["cold"] is False and second["sits"]["cuda_ctx_ms"] == 0
    assert second["sits"]["limits"]["memory_fraction"] is not None


def test_vram_cap_fails_the_task_and_the_child_survives(app: Celery,
                                                        worker: CeleryProcess) -> None:
    call(app, "t.describe", "warm", timeout=FIRST_CALL_S)
    # Given class "gpu2" (2 GiB), a 4 GiB allocation fails with the class named
    with pytest.raises(VramLimitExceeded, match="2 GiB VRAM limit of class 'gpu2'"):
        call(app, "t.alloc", 4.0, sla_class="gpu2")
    # And the same child then runs a 1 GiB task in that class, memory released in between
    ok = call(app, "t.alloc", 1.0, sla_class="gpu2")
    assert ok["output"]["device"].startswith("cuda")
    assert GIB <= ok["output"]["allocated_bytes"] < 2 * GIB
    assert worker.alive()


def test_more_children_than_gpus_share_round_robin(
        tmp_path_factory: pytest.TempPathFactory, redis_url: str, setup: tuple[Path, Path],
        app: Celery) -> None:
    gpus = nvml_devices()
    models, config = setup
    proc = spawn_worker(redis_url, config, models, tmp_path_factory.mktemp("logs2"),
                        concurrency=len(gpus) + 1, name="gpu-rr")
    try:
        wait_ready(app, [proc], timeout_s=120)
        # Every child logs its pinning at start: slot n lands on GPU n mod len(gpus)
        wait_for(lambda: len(PINNED.findall(proc.log())) >= len(gpus) + 1, 60,
                 "every child to pin itself")
        pinned = {int(slot): uuid for slot, uuid in PINNED.findall(proc.log())}
        assert pinned == {slot: gpus[slot % len(gpus)]["uuid"]
                          for slot in range(len(gpus) + 1)}
    finally:
        proc.stop(timeout_s=30)
    # The parent (like this test process) never touched CUDA, so forking was safe
    assert "Cannot re-initialize CUDA" not in proc.log()



def test_precisions_on_a_gpu(app: Celery, worker: CeleryProcess) -> None:
    # int8 layers are served on the CPU only: fp16 on a GPU, and the result says why
    got = call(app, "sits.generate", "Once upon a time", model="gpt", precision="int8",
               timeout=FIRST_CALL_S)
    meta = got["sits"]["precision"]
    assert meta["requested"] == "int8" and meta["served"] == "fp16"
    assert "TensorRT" in meta["reason"] and got["sits"]["device"].startswith("cuda")
    bf16 = call(app, "sits.generate", "Once upon a time", model="gpt", precision="bf16")
    assert bf16["sits"]["precision"]["served"] == "bf16"
    assert bf16["output"]["tokens"] > 0


def test_embeds_waiting_together_run_as_one_batch_on_the_gpu(
        app: Celery, worker: CeleryProcess) -> None:
    from sits_queue.broker.bulk import enqueue_many

    call(app, "sits.embed", "warm", model="enc", timeout=FIRST_CALL_S)
    # One put for all 40: they wait together, so the worker's next pick takes them in
    # batches of at most 32 (batch_max_tasks)
    ids = enqueue_many(app.tasks["sits.embed"], [(f"text number {i}",) for i in range(40)],
                       model="enc")
    results = [app.AsyncResult(i).get(timeout=60) for i in ids]
    sizes = [r["sits"]["batch"]["size"] for r in results]
    assert max(sizes) > 1 and all(s <= 32 for s in sizes)
    assert all(r["sits"]["device"].startswith("cuda") for r in results)
    assert len({len(r["output"]) for r in results}) == 1


def test_generations_batch_greedy_and_sampled_on_the_gpu(app: Celery,
                                                         worker: CeleryProcess) -> None:
    from sits_queue.broker.bulk import enqueue_many

    call(app, "sits.generate_batched", "warm", model="gpt", timeout=FIRST_CALL_S)
    # prompt, max_new_tokens (rows leave the batch at 2 to 9 tokens, their KV rows dropped
    # on the device), temperature (every other one sampled), seed, stop_at_eos
    calls = [(f"prompt number {i}", 2 + i % 8, 1.2 if i % 2 else 0.0, i, False)
             for i in range(12)]
    ids = enqueue_many(app.tasks["sits.generate_batched"], calls, model="gpt")
    results = [app.AsyncResult(i).get(timeout=60) for i in ids]
    assert max(r["sits"]["batch"]["size"] for r in results) > 1
    assert [r["output"]["tokens"] for r in results] == [c[1] for c in calls]
    assert all(r["sits"]["device"].startswith("cuda") for r in results)
    assert all(r["sits"]["first_token_ms"] > 0 for r in results)


def test_a_batch_mixing_templates_prefills_each_once_on_the_gpu(
        app: Celery, worker: CeleryProcess) -> None:
    from sits_queue.broker.bulk import enqueue_many

    templates = ("Summarise this operations log in one line and keep every number: ",
                 "Translate this status line into plain words for a customer who does not "
                 "run the cluster, in one short sentence: ")
    call(app, "sits.generate_batched", "warm", model="gpt", timeout=FIRST_CALL_S)
    calls = [(templates[i % 2] + f"line {i}", 4, 0.0, 0, False) for i in range(8)]
    ids = enqueue_many(app.tasks["sits.generate_batched"], calls, model="gpt")
    results = [app.AsyncResult(i).get(timeout=60) for i in ids]
    assert all(r["output"]["tokens"] == 4 for r in results)
    assert all(r["sits"]["device"].startswith("cuda") for r in results)
    # Rows batched with another of their template's share that template's start
    together = [(i, r) for i, r in enumerate(results) if r["sits"]["batch"]["size"] >= 4]
    assert together and all(r["output"]["shared_tokens"] >= 16 for _, r in together)
    by_template = {i % 2: r["output"]["shared_tokens"] for i, r in together}
    if len(by_template) == 2:  # each its own template's: the longer one shares more
        assert by_template[1] > by_template[0]


def test_generations_join_a_running_batch_on_the_gpu(app: Celery,
                                                     worker: CeleryProcess) -> None:
    # batch_join "auto": a worker with GPUs takes joins. The "slow" model (the tiny GPT,
    # 20 ms a forward) keeps the long row decoding while the later ones arrive.
    def gen(prompt: str, n: int, **options: Any) -> Any:
        return app.tasks["sits.generate_batched"].apply_async(
            (prompt,), {"max_new_tokens": n, "stop_at_eos": False}, model="slow", **options)

    gen("warm", 1).get(timeout=FIRST_CALL_S)
    long = gen("once upon a time", 150)
    gen("the cat", 2).get(timeout=60)  # stored early: the long row is decoding
    later = [gen(f"later prompt {i}", 3 + i) for i in range(4)]
    got = [r.get(timeout=60) for r in later]
    done = long.get(timeout=60)
    assert [g["output"]["tokens"] for g in got] == [3, 4, 5, 6]
    assert all(g["sits"]["batch"].get("joined") for g in got)
    assert all(r.date_done < long.date_done for r in later)
    assert done["output"]["tokens"] == 150


# Last of the worker's tests: a replacement child that hangs costs only this test.
def test_hard_limit_kill_frees_gpu_memory_and_the_slot_keeps_its_gpu(
        app: Celery, worker: CeleryProcess) -> None:
    before = call(app, "t.describe", "before", timeout=FIRST_CALL_S)
    device = next(g for g in nvml_devices() if g["uuid"] == before["output"]["cuda_visible"])
    baseline = device["used"]

    def used() -> int:
        return int(next(g["used"] for g in nvml_devices() if g["uuid"] == device["uuid"]))

    # When a task holding 8 GiB, deaf to its soft limit, is killed at its hard limit
    held = app.tasks["t.alloc"].apply_async((8.0, 120.0, True), sla_class="high",
                                            soft_time_limit=4, time_limit=8)
    wait_for(lambda: used() >= baseline + 7 * GIB, 60, "the task to hold 8 GiB")
    with pytest.raises(TimeLimitExceeded):
        held.get(timeout=60)
    # Then the device gets the memory back (the process is gone, its context with it)
    wait_for(lambda: used() <= baseline + GIB, 30, "the killed child's memory to be freed")
    # And the replacement child has the same GPU and serves. Its first call is cold (a
    # CUDA context, a load: 20 s of the class's 30 s for the first child on the H200
    # host): it gets more. (There, 2026-12-04, a replacement child hung in this call to
    # its limit: see workers/nvmlfork.py; a failure now says where it waits.)
    began = time.monotonic()
    pending = app.tasks["t.describe"].apply_async(
        ("after",), soft_time_limit=REPLACED_CALL_S - 10, time_limit=REPLACED_CALL_S)
    blocked = ""
    try:
        try:
            after = pending.get(timeout=SLOW_FIRST_CALL_S)
        except CeleryTimeoutError:  # where is it? (before the hard limit kills it)
            blocked = where_blocked(worker.pid)
            # On disk at once, beside the worker's log (the GPU check keeps both), in
            # case the check's time box stops the run before this test can report
            note = worker.log_path.with_name("blocked.log")
            note.write_text(blocked + "\n")
            children = [c.pid for c in psutil.Process(worker.pid).children()]
            for pid in children:
                os.kill(pid, signal.SIGUSR2)  # its Python stacks, into the log
            # and below them, what each thread waits on (a lock, NVML, the driver)
            native = native_stacks(children)
            with note.open("a") as out:
                out.write(native + "\n")
            blocked += "\n" + native[-8000:]
            after = pending.get(timeout=REPLACED_CALL_S + 10 - SLOW_FIRST_CALL_S)
    except Exception as exc:
        raise AssertionError(f"the replacement child did not serve: {exc!r}\n{blocked}\n"
                             f"{worker.log()[-20000:]}") from exc
    print(f"replacement child's first call: {time.monotonic() - began:.1f} s, "
          f"{after['sits']}")
    assert after["output"]["pid"] != before["output"]["pid"]
    assert after["output"]["cuda_visible"] == before["output"]["cuda_visible"]
    assert after["sits"]["slot"] == before["sits"]["slot"]
    assert worker.alive()
