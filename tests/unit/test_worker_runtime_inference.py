"""Inference in-process (no worker, no Redis): the built-in generate/embed on tiny real
models, and run_inference's accounting and error mapping with a fake engine cache."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.app import make_app
from sits_queue.cache import kvwarm
from sits_queue.cache.engines import engine_from_path
from sits_queue.cache.pool import ColdStart, EngineTooLarge
from sits_queue.cache.pool import ModelLoadError as PoolLoadError
from sits_queue.config import SitsConfig
from sits_queue.errors import (
    ContextTooLong,
    InvalidInput,
    InvalidTaskOptions,
    ModelLoadError,
    UnknownModel,
    VramLimitExceeded,
)
from sits_queue.models import tiny
from sits_queue.workers import (
    advertise,
    batched,
    batchembed,
    batchgen,
    decoding,
    deferred,
    firsttoken,
    gpu,
    inference,
)
from sits_queue.workers import runtime as rt
from sits_queue.workers.devices import Device, Discovery
from tests.waiting import wait_for

CPU = Device(index=0, kind="cpu", name="cpu", uuid="cpu", total_vram_bytes=2**36,
             free_vram_bytes=2**35)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny.build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "lm", seed=0,
                                     n_positions=64)
    engine = engine_from_path("lm", path, "cpu")
    engine.to_device("cpu")
    return engine


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny.build_tiny_encoder(tmp_path_factory.mktemp("enc") / "enc", seed=0)
    engine = engine_from_path("enc", path, "cpu")
    engine.to_device("cpu")
    return engine


# -- generate ---------------------------------------------------------------------------------

def test_generate_is_greedy_and_deterministic(lm: Any) -> None:
    first = inference.generate(lm, "the worker loads", max_new_tokens=6, stop_at_eos=False)
    again = inference.generate(lm, "the worker loads", max_new_tokens=6, stop_at_eos=False)
    assert first == again
    assert first["tokens"] == 6 and first["stopped"] == "length" and first["prompt_tokens"] > 0


def test_generate_matches_huggingface_generate(lm: Any) -> None:
    # The hand-written KV-cache loop decodes exactly what transformers' own greedy one does.
    import torch

    ours = inference.generate(lm, "a model serves", max_new_tokens=5, stop_at_eos=False)
    tokenizer = lm.artifacts["tokenizer"]
    ids = tokenizer("a model serves", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = lm.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                 min_new_tokens=5, do_sample=False, use_cache=True,
                                 pad_token_id=tokenizer.pad_token_id)
    assert ours["text"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_sampling_is_seeded(lm: Any) -> None:
    a = inference.generate(lm, "the cache", max_new_tokens=6, temperature=1.5, seed=3)
    b = inference.generate(lm, "the cache", max_new_tokens=6, temperature=1.5, seed=3)
    assert a == b


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-8])
def test_a_tiny_temperature_tends_to_greedy_alone_and_in_a_batch(lm: Any,
                                                                  temperature: float) -> None:
    # (float32 logits / 1e-40 overflowed: NaN probabilities, the whole batch failed)
    greedy = inference.generate(lm, "the cache", max_new_tokens=6)
    cold = inference.generate(lm, "the cache", max_new_tokens=6, temperature=temperature)
    assert cold["text"] == greedy["text"]
    got = batchgen.generate_calls(lm, [
        batched.Call("a", ("the cache", 6), {"temperature": temperature}),
        batched.Call("b", ("a queue", 5), {"temperature": 1.5, "seed": 3})])
    assert got[0]["text"] == greedy["text"]
    assert got[1] == {**inference.generate(lm, "a queue", max_new_tokens=5, temperature=1.5,
                                           seed=3), "cached_tokens": 0, "shared_tokens": 0}


class YieldAt(Exception):
    """Stands in for Preempted: carries the state a yield point was given, as JSON."""

    def __init__(self, state: Any) -> None:
        super().__init__("yielded")
        self.state = json.loads(json.dumps(state))  # what preempt.lua would keep


def runs_until_done(lm: Any, cut_at: set[int], **kwargs: Any) -> tuple[dict[str, Any], int]:
    """``generate`` as a worker runs it, yielding after each token count in ``cut_at``
    and resuming from the checkpoint; returns the final result and how many runs."""
    checkpoint: Any = None
    for attempt in range(1, 50):
        def yielder(state: Any, remaining_s: float | None) -> None:
            assert remaining_s is not None and remaining_s >= 0
            if len(state["new"]) in cut_at:
                cut_at.discard(len(state["new"]))
                raise YieldAt(state)

        active = rt.ActiveTask("lm", SitsConfig().quota("low"), lm.size_bytes(), "cpu",
                               yielder=yielder, checkpoint=checkpoint)
        try:
            with rt.activated(active):
                return inference.generate(lm, **kwargs), attempt
        except YieldAt as y:
            checkpoint = y.state
    raise AssertionError("never finished")


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_generation_cut_by_yields_resumes_to_the_same_output(lm: Any,
                                                                temperature: float) -> None:
    kwargs = {"prompt": "the slot yields", "max_new_tokens": 12, "temperature": temperature,
              "seed": 5, "stop_at_eos": False}
    uncut = inference.generate(lm, **kwargs)
    # When the run is cut after 1, 4 and 11 tokens and resumed each time
    result, runs = runs_until_done(lm, {1, 4, 11}, **kwargs)
    # Then it decodes exactly what the uncut run did, and says it took four runs
    assert runs == 4 and result["runs"] == 4
    assert {k: v for k, v in result.items() if k != "runs"} == \
        {k: v for k, v in uncut.items() if k != "runs"}
    assert uncut["runs"] == 1


@pytest.mark.parametrize("checkpoint", [
    {"new": "abc", "runs": 1}, {"new": [-1], "runs": 1}, {"new": [10**9], "runs": 1},
    {"new": [1] * 12, "runs": 1}, {"new": [1], "runs": 0}, ["not", "a", "dict"],
])
def test_a_checkpoint_that_is_not_ours_starts_over(lm: Any, checkpoint: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    kwargs = {"prompt": "the slot yields", "max_new_tokens": 12, "stop_at_eos": False}
    active = rt.ActiveTask("lm", SitsConfig().quota("low"), lm.size_bytes(), "cpu",
                           checkpoint=checkpoint)
    with rt.activated(active), caplog.at_level("WARNING"):
        result = inference.generate(lm, **kwargs)
    assert result == inference.generate(lm, **kwargs)
    assert "checkpoint not understood" in caplog.text


@pytest.mark.parametrize(("args", "match"), [
    ((42,), "prompt must be a non-empty string"),
    (("",), "prompt must be a non-empty string"),
    (("hi", 0), "max_new_tokens"),
    (("hi", True), "max_new_tokens"),
    (("hi", 4, -1.0), "temperature"),
    (("hi", 4, 1.0, "7"), "seed must be an integer"),
    (("hi", 4, 1.0, False), "seed must be an integer"),
    # (past 64 bits a seed drew what another did: 2**80 and -2**80 alike)
    (("hi", 4, 1.0, 2**80), r"seed must be an integer in \[-2\*\*63, 2\*\*63\), got "),
    (("hi", 4, 1.0, 2**63), "seed must be an integer in"),
    (("hi", 4, 1.0, 0, "false"), "stop_at_eos must be true or false"),  # "false" is truthy
    (("hi \ud800",), "prompt is not valid Unicode text: surrogates not allowed at "
                     "character 3"),  # (the tokenizer's TypeError did not say)
])
def test_generate_rejects_malformed_input(lm: Any, args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        inference.generate(lm, *args)


def test_generating_with_an_encoder_says_it_is_not_a_language_model(encoder: Any) -> None:
    # (an AttributeError about 'logits' from deep in the decode loop)
    with pytest.raises(ModelLoadError, match="is not a causal language model"):
        inference.generate(encoder, "the beat")
    with pytest.raises(ModelLoadError, match="is not a causal language model"):
        batchgen.generate_calls(encoder, [batched.Call("a", ("the beat", 2), {})])


def test_generate_refuses_a_context_longer_than_the_model(lm: Any) -> None:
    with pytest.raises(ContextTooLong, match=r"exceeds model 'lm'.s 64 positions"):
        inference.generate(lm, "the queue " * 40)
    with pytest.raises(ContextTooLong):
        inference.generate(lm, "the queue", max_new_tokens=64)


def test_the_last_new_token_takes_no_position(lm: Any) -> None:
    """(the last new token is never fed back: a prompt with room for all but it was
    refused, as transformers' generate serves it)"""
    tokenizer = inference.tokenizer_of(lm, lm.key)
    prompt = "the queue"
    most = 64 + 1 - len(tokenizer(prompt)["input_ids"])
    assert inference.generate(lm, prompt, max_new_tokens=most, stop_at_eos=False)[
        "tokens"] == most
    rows = batchgen.generate_calls(lm, [
        batched.Call("a", (prompt, most), {"stop_at_eos": False}),
        batched.Call("b", ("the worker", 3), {"stop_at_eos": False}),
        batched.Call("c", (prompt, most + 1), {"stop_at_eos": False})])
    assert rows[0]["tokens"] == most and rows[1]["tokens"] == 3
    assert isinstance(rows[2], ContextTooLong)
    with pytest.raises(ContextTooLong, match=f"max_new_tokens {most + 1} exceeds"):
        inference.generate(lm, prompt, max_new_tokens=most + 1)


class StopsAt(rt.ActiveTask):
    """An active task whose soft limit arrives before step ``at``."""

    at = 3

    def check_time(self, done: int, total: int) -> None:
        if done >= self.at:
            raise SoftTimeLimitExceeded()


def test_soft_time_limit_stops_generation_between_steps(lm: Any) -> None:
    from sits_queue.config import DEFAULT_CLASSES

    active = StopsAt("lm", DEFAULT_CLASSES[0], 0, "cpu")
    with rt.activated(active), pytest.raises(SoftTimeLimitExceeded,
                                             match=r"stopped after 3 of 10 new tokens"):
        inference.generate(lm, "the gpu", max_new_tokens=10, stop_at_eos=False)
    assert rt.active() is None


def test_generation_is_refused_when_the_cpu_estimate_exceeds_the_class(lm: Any) -> None:
    from sits_queue.config import ClassQuota

    small = ClassQuota("small", cpu_cores=1, vram_gib=lm.size_bytes() * 1.05 / 2**30,
                       max_run_s=10, weight=1, latency_sla_ms=100, loss_sensitivity=0.5)
    with rt.activated(rt.ActiveTask("lm", small, lm.size_bytes(), "cpu")), \
            pytest.raises(VramLimitExceeded, match="estimated working memory"):
        inference.generate(lm, "the gpu", max_new_tokens=60)


def test_estimates_grow_with_tokens(lm: Any) -> None:
    assert decoding.kv_cache_bytes(lm.module, 100) > decoding.kv_cache_bytes(lm.module, 10)
    assert kvwarm.max_positions(lm.module) == 64


# -- first-token time (§4.4) ------------------------------------------------------------------

def test_generate_marks_its_first_token_on_a_running_clock(lm: Any) -> None:
    assert firsttoken.mark() is None  # no clock: nothing to mark, nothing breaks
    assert not firsttoken.waiting()
    with firsttoken.first_token_clock() as clock:
        assert firsttoken.waiting()
        inference.generate(lm, "the clock runs", max_new_tokens=5, stop_at_eos=False)
        assert not firsttoken.waiting()
    assert clock.ms is not None and clock.ms > 0
    assert clock.mark() == clock.ms  # marked once: later tokens do not move it


def test_a_resumed_generation_reports_its_first_runs_first_token(lm: Any) -> None:
    checkpoint: Any = None
    firsts: list[float | None] = []
    for _ in range(3):  # cut after 2 and 5 tokens, as a worker's yields would
        active = rt.ActiveTask("lm", SitsConfig().quota("low"), lm.size_bytes(), "cpu",
                               yielder=lambda state, _s: cut(state, {2, 5}),
                               checkpoint=checkpoint)
        with firsttoken.first_token_clock() as clock, rt.activated(active):
            try:
                inference.generate(lm, "the slot yields", max_new_tokens=8,
                                   stop_at_eos=False)
            except YieldAt as y:
                checkpoint = y.state
        firsts.append(clock.ms)
    assert firsts[0] is not None and firsts == [firsts[0]] * 3
    assert checkpoint["first_token_ms"] == firsts[0]


def cut(state: Any, at: set[int]) -> None:
    if len(state["new"]) in at:
        at.discard(len(state["new"]))
        raise YieldAt(state)


@pytest.mark.parametrize("saved", ["12", -1.0, float("nan"), True, None, [3]])
def test_a_saved_first_token_time_that_is_not_a_time_is_ignored(saved: Any) -> None:
    with firsttoken.first_token_clock() as clock:
        assert firsttoken.carry(saved) is None
    assert clock.ms is None


# -- generate_batched in-process -----------------------------------------------------------------

def test_a_batch_mixes_greedy_and_sampled_rows_each_as_it_would_decode_alone(lm: Any) -> None:
    rows = [("the cache warms", 6, 0.0, 0), ("a queue", 9, 1.5, 3),
            ("the worker loads a model and", 4, 0.8, 11), ("once", 7, 1.5, 4)]
    calls = [batched.Call(str(i), (p, n), {"temperature": t, "seed": s})
             for i, (p, n, t, s) in enumerate(rows)]
    with firsttoken.first_token_clock() as clock:
        got = batchgen.generate_calls(lm, calls)
    for (prompt, n, t, s), out in zip(rows, got, strict=True):
        alone = inference.generate(lm, prompt, max_new_tokens=n, temperature=t, seed=s)
        assert out == {**alone, "cached_tokens": 0, "shared_tokens": 0}, prompt
    assert clock.ms is not None and clock.ms > 0
    # Another seed samples another continuation (the seed is used, per row)
    other = batchgen.generate_calls(lm, [batched.Call("x", ("a queue", 9),
                                                     {"temperature": 1.5, "seed": 4})])
    assert other[0]["text"] != got[1]["text"]


def test_a_call_with_a_bad_seed_fails_alone(lm: Any) -> None:
    got = batchgen.generate_calls(lm, [batched.Call("a", ("the cache",), {"seed": "x"}),
                                      batched.Call("b", ("the cache", 3), {})])
    assert isinstance(got[0], InvalidInput) and "seed must be an integer" in str(got[0])
    assert got[1]["tokens"] >= 1


# -- embed ------------------------------------------------------------------------------------

def test_embed_mean_pools_and_normalises(encoder: Any) -> None:
    one = inference.embed(encoder, "the beat scores")
    many = inference.embed(encoder, ["the beat scores", "a client streams the next token"])
    assert len(one) == 64 and len(many) == 2
    assert sum(x * x for x in one) == pytest.approx(1.0, abs=1e-5)
    # Padding a shorter text in a batch does not change its vector (the mask excludes pads)
    assert many[0] == pytest.approx(one, abs=1e-5)


@pytest.mark.parametrize("texts", [[], [""], ["ok", 3], 7, None])
def test_embed_rejects_malformed_input(encoder: Any, texts: Any) -> None:
    with pytest.raises(InvalidInput):
        inference.embed(encoder, texts)


def test_a_lone_surrogate_fails_its_call_alone(lm: Any, encoder: Any) -> None:
    # (the tokenizer's TypeError failed every call of the batch, naming nothing)
    got = batchembed.embed_calls(encoder, [batched.Call("a", (["ok", "bad \udc80"],), {}),
                                        batched.Call("b", (["the beat"],), {})])
    assert isinstance(got[0], InvalidInput) and "texts item 1 is not valid Unicode" \
        in str(got[0])
    assert got[1] == [inference.embed(encoder, "the beat")]
    gen = batchgen.generate_calls(lm, [batched.Call("a", ("bad \ud800", 3), {}),
                                       batched.Call("b", ("the cache", 3), {})])
    assert isinstance(gen[0], InvalidInput) and gen[1]["tokens"] >= 1


def test_calls_over_the_per_run_text_limit_embed_in_runs_not_one_by_one(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call may bring up to 1,024 texts, a batch of them more: the joint run was
    refused on its size and every call ran alone."""
    runs: list[int] = []
    real = inference.embed

    def counted(engine: Any, texts: Any, normalize: bool = True) -> Any:
        runs.append(len(texts) if isinstance(texts, list) else 1)
        return real(engine, texts, normalize)

    monkeypatch.setattr(inference, "embed", counted)
    texts = [f"line {n}" for n in range(400)]
    calls = [batched.Call(str(i), (texts,), {}) for i in range(6)]  # 2,400 texts
    got = batchembed.embed_calls(encoder, calls)
    assert runs == [800, 800, 800]  # whole calls, at most 1,024 texts a run
    assert all(len(g) == 400 for g in got) and got[5][7] == pytest.approx(got[0][7])


def test_embed_takes_normalize_as_a_bool_only(encoder: Any) -> None:
    with pytest.raises(InvalidInput, match="normalize must be true or false"):
        inference.embed(encoder, "the beat", normalize="false")
    calls = [batched.Call("a", (["the beat"],), {"normalize": "no"}),
             batched.Call("b", (["the beat"],), {"normalize": False})]
    got = batchembed.embed_calls(encoder, calls)
    assert isinstance(got[0], InvalidInput) and "normalize" in str(got[0])
    assert got[1] == [inference.embed(encoder, "the beat", normalize=False)]


def test_a_causal_lm_embeds_its_last_hidden_states_not_its_logits(lm: Any) -> None:
    module = inference.module_of(lm, "lm")
    vector = inference.embed(lm, "the cache warms")
    assert len(vector) == module.config.hidden_size != module.config.vocab_size
    assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-5)


def test_embed_refuses_too_long_texts(encoder: Any) -> None:
    # (short enough in characters to be tokenized: too long in tokens)
    with pytest.raises(ContextTooLong, match="takes at most 256"):
        inference.embed(encoder, "the queue " * 200)


def test_builtins_need_a_tokenizer_and_a_module() -> None:
    bare = SimpleNamespace(key="bare", artifacts={}, module=object())
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        inference.generate(bare, "hi")
    onnx = SimpleNamespace(key="o", artifacts={"tokenizer": object()}, backend="onnxruntime")
    with pytest.raises(ModelLoadError, match="onnxruntime engine"):
        inference.embed(onnx, "hi")


# -- run_inference with a fake cache ----------------------------------------------------------

class FakeEngine:
    key = "m"
    artifacts: dict[str, Any] = {}

    def __init__(self, size: int = 1000) -> None:
        self.size = size

    def size_bytes(self) -> int:
        return self.size


class FakeCache:
    def __init__(self, outcome: Callable[[], tuple[Any, ColdStart]]) -> None:
        self.outcome = outcome

    def get(self, key: str, loader: Callable[[], Any]) -> tuple[Any, ColdStart]:
        return self.outcome()

    def warm(self) -> dict[str, str]:
        return {"m": "device"}

    def warm_bytes(self) -> dict[str, int]:
        return {"m": 1000}


@pytest.fixture
def app() -> Iterator[Celery]:
    app = make_app(SitsConfig(), main="infer-unit")
    app.register_model("m", lambda: FakeEngine())
    yield app


#: The runtimes :func:`child` made in this test: :func:`flushed` writes what they defer.
MADE: list[rt.ChildRuntime] = []


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Advertisement writes, captured instead of sent to Redis."""
    seen: list[Any] = []
    monkeypatch.setattr(advertise, "publish_child", lambda *a: not seen.append(a[3:]))
    MADE.clear()
    yield seen
    flushed(seen)  # (here, not later from the writer's thread to the default Redis)


def flushed(published: list[Any]) -> list[Any]:
    """``published`` with what the runtimes' deferred writers hold written too (counts
    of a run that changed no warm set wait up to ``deferred.DEFER_S`` otherwise)."""
    for runtime in MADE:
        runtime.flush_advert()
    return published


def counts_of(published: list[Any]) -> dict[str, Any]:
    """The counts a run published, summed (once it has its engine, and when it ends)."""
    total: dict[str, Any] = {}
    for _, counts in flushed(published):
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return total


def child(app: Celery, outcome: Callable[[], tuple[Any, ColdStart]]) -> rt.ChildRuntime:
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    MADE.append(rt.ChildRuntime(app=app, plan=plan, slot=0, device=CPU,
                                cache_factory=lambda *a, **k: FakeCache(outcome)))
    return MADE[-1]


def fake_task(run: Callable[..., Any], model: str = "m", sla_class: str = "low") -> Any:
    request = SimpleNamespace(sits={"model": model, "sla_class": sla_class},
                              timelimit=(10, 8))
    return SimpleNamespace(request=request, model=None, sla_class=None, run=run)


COLD = ColdStart(True, "disk", 0.0, 12.5, 0.5, 3.0)


def test_result_carries_output_and_cold_start_accounting(app: Celery,
                                                         published: list[Any]) -> None:
    result = inference.run_inference(child(app, lambda: (FakeEngine(), COLD)),
                                     fake_task(lambda engine, x: x * 2), (21,), {})
    assert result["output"] == 42
    meta = result["sits"]
    assert meta["cold"] is True and meta["source"] == "disk" and meta["load_ms"] == 12.5
    assert meta["run_ms"] >= 0 and meta["device"] == "cpu" and meta["sla_class"] == "low"
    assert meta["limits"]["soft_time_limit_s"] == 8 and meta["limits"]["time_limit_s"] == 10
    counts = counts_of(published)
    record, _ = published[-1]
    assert record["warm"] == {"m": "device"} and record["tasks"] == 1
    assert record["warm_bytes"] == {"m": 1000}  # the cache's sizes (sitsq status shows them)
    assert published[0][0]["tasks"] == 1  # (out before the run ended)
    # the counts go out with the record: the class, the source, ms per phase, the bucket
    run_ms = counts.pop("model_run_ms:m")
    assert run_ms == meta["run_ms"]
    assert counts == {"tasks": 1, "tasks:low": 1, "runs": 1, "cold_runs": 1, "cold": 1,
                      "cold:disk": 1, "cold_ms": 16.0,
                      "cold_le:25": 1, "phase_ms:load": 12.5, "phase_ms:promote": 0.5,
                      "phase_ms:warmup": 3.0, "model_cold:m": 1, "model_cold_ms:m": 16.0,
                      "model_runs:m": 1}


def test_a_retried_run_is_no_new_task(app: Celery, published: list[Any]) -> None:
    """(a task that failed and was retried counted once per run, as two tasks: a
    resumed one counts once, and so does a retried one)"""
    task = fake_task(lambda engine, x: x)
    task.request.retries = 1
    inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), task, (1,), {})
    counts = counts_of(published)
    assert "tasks" not in counts and "tasks:low" not in counts
    assert counts["runs"] == 1 and counts["cold"] == 1  # its run and its cold start count


WARM = ColdStart(False, "device", 0.0, 0.0, 0.0, 0.0)


def test_counts_of_runs_that_route_nothing_differently_go_in_one_later_write(
        app: Celery, published: list[Any]) -> None:
    """(two synchronous writes per task were ~2 ms of a 14 ms embedding task)"""
    outcomes = [COLD, WARM]
    runtime = child(app, lambda: (FakeEngine(), outcomes.pop(0)))
    task = fake_task(lambda engine, x: x)
    # Given a first run that loaded the model: its new warm set is written at once
    inference.run_inference(runtime, task, (1,), {})
    assert len(published) == 1 and published[0][0]["warm"] == {"m": "device"}
    # When a warm run follows, changing nothing another process routes work by
    inference.run_inference(runtime, task, (2,), {})
    # Then neither the first run's end nor the second run wrote before returning...
    assert len(published) == 1
    # ...and the deferred writer sends both runs' counts in one write
    wait_for(lambda: len(published) >= 2, 20 * deferred.DEFER_S, "the deferred write")
    record, counts = published[1]
    assert record["tasks"] == 2 and counts["tasks"] == 1 and counts["model_runs:m"] == 2
    assert counts_of(published)["tasks"] == 2 and len(published) == 2  # (nothing left)


def holding(held: dict[str, str]) -> Any:
    """A cache factory whose cache holds what ``held`` says (a test changes it)."""
    class Cache(FakeCache):
        def warm(self) -> dict[str, str]:
            return dict(held)

        def warm_bytes(self) -> dict[str, int]:
            return {key: 1000 for key in held}

    return lambda *a, **k: Cache(lambda: (FakeEngine(), WARM))


def test_a_run_that_changes_the_warm_set_writes_it_before_it_returns(
        app: Celery, published: list[Any]) -> None:
    held = {"m": "device"}
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    runtime = rt.ChildRuntime(app=app, plan=plan, slot=0, device=CPU,
                              cache_factory=holding(held))

    def run(engine: Any) -> str:
        held["other"] = "host"  # (a demotion: what affinity and steering weigh changed)
        return "done"

    inference.run_inference(runtime, fake_task(run), (), {})
    assert [r["warm"] for r, _ in published] == [{"m": "device"},
                                                 {"m": "device", "other": "host"}]


def test_a_child_counts_only_the_writes_that_change_what_routes_work(
        app: Celery, published: list[Any]) -> None:
    """(the main process reads its children's records again after an ack only when a
    count moved: workers/routingversions.py)"""
    from sits_queue.workers import routingversions

    held = {"m": "device"}
    routingversions.create(2)
    try:
        plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 2)
        runtime = rt.ChildRuntime(app=app, plan=plan, slot=1, device=CPU,
                                  cache_factory=holding(held))
        runtime.publish()  # the child's first record: nothing held yet
        assert routingversions.reading()[:2] == (0, 1)  # type: ignore[index]
        inference.run_inference(runtime, fake_task(lambda engine: "load"), (), {})
        assert routingversions.reading()[:2] == (0, 2)  # type: ignore[index]
        for _ in range(3):  # warm runs: counts only, written later
            inference.run_inference(runtime, fake_task(lambda engine: "warm run"), (), {})
        assert routingversions.reading()[:2] == (0, 2)  # type: ignore[index]

        def demote(engine: Any) -> str:
            held["other"] = "host"
            return "done"

        inference.run_inference(runtime, fake_task(demote), (), {})
        assert routingversions.reading()[:2] == (0, 3)  # type: ignore[index]
    finally:
        routingversions.forget()


def test_a_write_redis_refused_is_made_again_at_once(app: Celery,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    answers = [False, True, True]
    MADE.clear()
    monkeypatch.setattr(advertise, "publish_child",
                        lambda *a: sent.append(a[3:]) is None and answers.pop(0))
    runtime = child(app, lambda: (FakeEngine(), WARM))
    runtime.publish()  # refused: Redis away
    runtime.count({"tasks": 1})
    runtime.publish()  # the same record: still written at once, with the kept counts
    assert len(sent) == 2 and sent[1][1] == {"tasks": 1}
    runtime.publish()  # taken before: now it waits...
    assert len(sent) == 2
    runtime.flush_advert()  # ...for the writer, or a child's clean exit
    assert len(sent) == 3
    runtime.flush_advert()  # (nothing more held)
    assert len(sent) == 3


class FakeClock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_token_time_counts_from_before_the_engine_is_got(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(firsttoken.time, "perf_counter", clock)

    def acquire() -> tuple[Any, ColdStart]:
        clock.now += 0.25  # the load
        return FakeEngine(), COLD

    def run(engine: Any) -> str:
        clock.now += 0.02  # the prefill
        firsttoken.mark()
        clock.now += 0.5  # the rest of the decode
        return "text"

    result = inference.run_inference(child(app, acquire), fake_task(run), (), {})
    assert result["sits"]["first_token_ms"] == 270.0
    assert result["sits"]["run_ms"] == 520.0
    _, counts = flushed(published)[-1]
    assert (counts["ftt"], counts["ftt_ms"], counts["ftt_le:500"]) == (1, 270.0, 1)
    # A task that makes no tokens says so, and counts no first token
    plain = inference.run_inference(child(app, lambda: (FakeEngine(), COLD)),
                                    fake_task(lambda e: 1), (), {})
    assert plain["sits"]["first_token_ms"] is None and "ftt" not in flushed(published)[-1][1]


def test_the_cooperative_soft_deadline_counts_from_the_runs_start_load_included(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from sits_queue.workers import slices

    # Given a run that began 5 s ago (task_prerun's record), its engine loaded meanwhile
    task = fake_task(lambda engine: rt.active().soft_deadline)
    task.request.id = "run-1"
    began = time.monotonic() - 5.0
    monkeypatch.setitem(slices._starts, "run-1", began)
    deadline = inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), task, (),
                                       {})["output"]
    # Then its between-steps check stops it where the pool's soft limit (8 s) would: it
    # counted from after the load, so after a cold start the pool's signal always came
    # first, load time ahead of it
    assert deadline == began + 8


def test_a_sliced_tasks_every_run_is_the_models_service_time(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from sits_queue.workers.slices import Preempted

    clock = FakeClock()
    monkeypatch.setattr(inference.time, "perf_counter", clock)

    def sliced(engine: Any) -> str:
        clock.now += 0.3
        raise Preempted("yielded its slot after 'low' time slice")

    with pytest.raises(Preempted):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(sliced),
                                (), {})
    # The slice that yielded served the model for 300 ms, and is no task served yet
    _, counts = flushed(published)[-1]
    assert counts["model_run_ms:m"] == 300.0 and "model_runs:m" not in counts

    def rest(engine: Any) -> str:
        clock.now += 0.1
        return "done"

    inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(rest), (), {})
    # The run that finished counts the task: the model served it for 300 + 100 ms
    _, counts = flushed(published)[-1]
    assert counts["model_run_ms:m"] == 100.0 and counts["model_runs:m"] == 1


def test_a_batch_delivers_a_call_early_with_its_metadata_as_of_then(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(inference.time, "perf_counter", clock)
    taken: list[tuple[int, Any, dict[str, Any]]] = []

    def run(engine: Any) -> Any:
        active = rt.active()
        assert active is not None
        clock.now += 0.1
        assert active.deliver(1, "early")  # call 1 is done: stored now
        assert not active.deliver(1, "again")  # once
        clock.now += 0.4
        raise KeyError("the rest failed")

    def early(i: int, out: Any, meta: dict[str, Any]) -> bool:
        if any(i == t[0] for t in taken):
            return False
        taken.append((i, out, meta))
        return True

    with pytest.raises(KeyError):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(run),
                                (), {}, tasks=3, early=early)
    [(index, output, meta)] = taken
    assert (index, output) == (1, "early")
    assert meta["run_ms"] == 100.0 and meta["cold"] is True and meta["sla_class"] == "low"
    # the failure counts the two calls it failed, not the one delivered before it
    counts = counts_of(published)
    assert counts["tasks"] == 3 and counts["failed"] == 2


def test_oom_while_running_is_a_vram_limit_failure_and_memory_is_released(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    released: list[bool] = []
    monkeypatch.setattr(gpu, "release_memory", lambda: released.append(True))

    def run(engine: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(VramLimitExceeded, match=r"8 GiB VRAM limit of class 'low'.*20.00 GiB"):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(run),
                                (), {})
    assert released == [True]


def test_oom_the_task_retries_on_still_has_its_memory_released(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(``autoretry_for=(RuntimeError,)``: Celery's wrapper makes the out-of-memory error
    a Retry before the run sees it, and the allocator kept the memory for the next task)"""
    import torch
    from celery.exceptions import Retry

    released: list[bool] = []
    monkeypatch.setattr(gpu, "release_memory", lambda: released.append(True))

    def run(engine: Any) -> Any:
        raise Retry(exc=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))

    with pytest.raises(Retry) as raised:
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(run),
                                (), {})
    assert released == [True]
    assert isinstance(raised.value.exc, torch.OutOfMemoryError)
    assert raised.value.exc.__traceback__ is None  # (its frames held the run's tensors)
    # while a retry for anything else is the task's own business
    released.clear()

    def other(engine: Any) -> Any:
        raise Retry(exc=KeyError("flaky"))

    with pytest.raises(Retry):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(other),
                                (), {})
    assert released == []


def test_other_task_errors_pass_through(app: Celery, published: list[Any]) -> None:
    def run(engine: Any) -> Any:
        raise KeyError("user bug")

    with pytest.raises(KeyError):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), fake_task(run),
                                (), {})


def raising(exc: BaseException) -> Callable[[], tuple[Any, ColdStart]]:
    def outcome() -> tuple[Any, ColdStart]:
        raise exc

    return outcome


@pytest.mark.parametrize(("exc", "error", "match"), [
    (PoolLoadError("m", ModelLoadError("loader for model 'm' failed: OSError: gone")),
     ModelLoadError, r"^loader for model 'm' failed: OSError: gone$"),
    (PoolLoadError("m", OSError("gone")), ModelLoadError, "loading model 'm' failed"),
    (PoolLoadError("m", RuntimeError("CUDA out of memory")), VramLimitExceeded,
     "out of device memory loading model 'm'"),
    (EngineTooLarge("m", 10, 5), VramLimitExceeded, "does not fit this worker's engine cache"),
])
def test_cache_errors_are_mapped(app: Celery, published: list[Any], exc: BaseException,
                                 error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        inference.run_inference(child(app, raising(exc)), fake_task(lambda e: 1), (), {})
    assert type(info.value).__module__ == "sits_queue.errors"  # JSON-serialisable by message


def test_autoretry_for_takes_load_failures_and_load_oom_not_what_is_the_same_each_time(
        app: Celery, published: list[Any]) -> None:
    """(``workers/autoretry.py``: an engine too large for its class, a model no one
    registers, were retried for minutes; a load short of device memory was not)"""
    from celery.exceptions import Retry

    def retrying(model: str = "m") -> Any:
        task = fake_task(lambda e: 1, model=model)
        task.autoretry_for = (ModelLoadError, VramLimitExceeded, UnknownModel)
        task.request.retries = 0

        def retry(exc: BaseException, **_: Any) -> Retry:
            task.retried = exc
            return Retry(exc=exc)

        task.retry = retry
        return task

    for cause in (OSError("store timed out"), RuntimeError("CUDA out of memory")):
        task = retrying()
        with pytest.raises(Retry):
            inference.run_inference(child(app, raising(PoolLoadError("m", cause))), task,
                                    (), {})
        assert isinstance(task.retried, ModelLoadError | VramLimitExceeded)
    huge, task = FakeEngine(size=9 * 2**30), retrying()
    with pytest.raises(VramLimitExceeded, match="limit of class 'low'"):
        inference.run_inference(child(app, lambda: (huge, COLD)), task, (), {})
    task = retrying(model="nope")
    with pytest.raises(UnknownModel):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)), task, (), {})
    assert not hasattr(task, "retried")


def test_unknown_model_and_class_limit(app: Celery, published: list[Any]) -> None:
    with pytest.raises(UnknownModel, match="'nope'"):
        inference.run_inference(child(app, lambda: (FakeEngine(), COLD)),
                                fake_task(lambda e: 1, model="nope"), (), {})
    huge = FakeEngine(size=9 * 2**30)
    with pytest.raises(VramLimitExceeded, match="limit of class 'low'"):
        inference.run_inference(child(app, lambda: (huge, COLD)), fake_task(lambda e: 1),
                                (), {})


def test_inference_task_direct_call_uses_a_local_runtime(
        app: Celery, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "_child", child(app, lambda: (FakeEngine(), COLD)))

    @app.inference_task(model="m", sla_class="low")
    def double(engine: Any, x: int) -> int:
        return 2 * x

    out = double(4)
    assert out["output"] == 8 and out["sits"]["sla_class"] == "low"


def test_models_whose_loaders_name_their_engines_alike_get_their_own_vectors(
        tmp_path: Any, published: list[Any]) -> None:
    """Two models whose loaders built engines under one name: the child's embedding
    cache is keyed by the engine's key, and the second model got the first's vectors."""
    app = make_app(SitsConfig(), main="infer-keys")
    for name, seed in (("enc-x", 0), ("enc-y", 5)):
        path = tiny.build_tiny_encoder(tmp_path / name, seed=seed)
        app.register_model(name, lambda path=path: engine_from_path("encoder", path, "cpu"))
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    runtime = rt.ChildRuntime(app=app, plan=plan, slot=0, device=CPU)

    def embed(model: str) -> Any:
        task = SimpleNamespace(request=SimpleNamespace(sits={"model": model}, id=model,
                                                       timelimit=(None, None)),
                               model=None, sla_class=None, run=inference.embed)
        return inference.run_inference(runtime, task, ("the worker loads",), {})["output"]

    x, y = embed("enc-x"), embed("enc-y")
    alone = engine_from_path("enc-y", tmp_path / "enc-y", "cpu")
    alone.to_device("cpu")
    assert x != y and y == pytest.approx(inference.embed(alone, "the worker loads"))


@pytest.mark.parametrize(("args", "kwargs", "said"), [
    ((), {}, "missing a required argument: 'x'"),
    ((1, 2), {}, "too many positional arguments"),
    ((1,), {"max_tokens": 3}, "got an unexpected keyword argument 'max_tokens'"),
])
def test_arguments_the_function_does_not_take_are_invalid_input_before_the_engine(
        app: Celery, published: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
        said: str) -> None:
    """(a producer sending by name, with no Celery type check: a TypeError from inside,
    counted as a crash, its count including the engine, after the model loaded)"""
    loads: list[int] = []

    def acquire() -> tuple[Any, ColdStart]:
        loads.append(1)
        return FakeEngine(), COLD

    task = fake_task(lambda engine, x: x)
    task.name = "t.double"
    with pytest.raises(InvalidInput, match=f"t.double arguments: {said}"):
        inference.run_inference(child(app, acquire), task, args, kwargs)
    assert loads == []


def test_a_texts_vector_does_not_depend_on_its_batch_when_the_tokenizer_pads_left(
        lm: Any) -> None:
    """(many decoder-only checkpoints ship padding_side "left": each real token's position
    moved by its padding, and the vector with it)"""
    tokenizer = lm.artifacts["tokenizer"]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        alone = inference.embed(lm, "the worker")
        batched = inference.embed(lm, ["the worker", "the worker loads the prompt before "
                                       "noon and the queue evicts warm engines"])[0]
        assert batched == pytest.approx(alone, abs=1e-5)
        assert tokenizer.padding_side == "left"  # the checkpoint's setting is left as is
    finally:
        tokenizer.padding_side = side


def test_an_eager_call_runs_with_the_options_it_was_given(
        tmp_path: Any, published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(``task_always_eager``/``apply()`` keep the headers in request.headers: the call's
    model, class and precision were ignored, and sits.generate had no model at all)"""
    app = make_app(SitsConfig(), main="infer-eager")
    app.conf.task_always_eager = True
    app.register_model("lm-a", str(tiny.build_tiny_causal_lm(tmp_path / "a", seed=0)))
    app.register_model("lm-b", str(tiny.build_tiny_causal_lm(tmp_path / "b", seed=1)))
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    monkeypatch.setattr(rt, "_child", rt.ChildRuntime(app=app, plan=plan, slot=0, device=CPU))

    @app.inference_task(model="lm-a", shared=False)
    def which(engine: Any, x: int) -> str:
        return str(engine.key)

    got = which.apply_async((1,), model="lm-b", sla_class="low", precision="fp16").get()
    assert got["output"] == "lm-b@fp16" and got["sits"]["sla_class"] == "low"
    assert which.apply((1,)).get()["output"] == "lm-a"  # no options: the task's own
    gen = app.tasks["sits.generate"].apply_async(("the worker",), {"max_new_tokens": 2},
                                                 model="lm-b").get()
    assert gen["output"]["tokens"] == 2
    # apply() itself takes them too (Celery's dropped them: a task running another
    # model's task in its process got its own model, the built-in tasks none)
    got = which.apply((1,), model="lm-b", sla_class="low", precision="fp16").get()
    assert got["output"] == "lm-b@fp16" and got["sits"]["sla_class"] == "low"
    gen = app.tasks["sits.generate"].apply(("the worker",), {"max_new_tokens": 2},
                                           model="lm-b").get()
    assert gen["output"]["tokens"] == 2
    with pytest.raises(InvalidTaskOptions, match="unknown sla_class"):
        which.apply((1,), sla_class="bogus")


def test_a_task_running_another_model_s_task_in_process_keeps_its_engine(
        published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(the inner task's model needed the room: the outer task's engine was demoted or
    released beneath it, and its next call failed)"""
    import torch

    from sits_queue.cache.budgets import CacheBudgets

    app = make_app(SitsConfig(), main="infer-nested")
    for name in ("outer-m", "inner-m"):
        app.register_model(name, lambda: torch.nn.Linear(256, 256),  # 263 kB each
                           sample_inputs=(torch.ones(1, 256),))
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    monkeypatch.setattr(rt, "_child", rt.ChildRuntime(
        app=app, plan=plan, slot=0, device=CPU,
        budgets=CacheBudgets(device_bytes=300_000, host_bytes=10**6)))  # room for one

    @app.inference_task(model="inner-m", shared=False)
    def inner(engine: Any, x: Any) -> float:
        return float(engine(x).sum())

    @app.inference_task(model="outer-m", shared=False)
    def outer(engine: Any, x: Any) -> dict[str, Any]:
        first = float(engine(x).sum())
        refused = inner.apply((x,))
        return {"inner": repr(refused.result), "again": float(engine(x).sum()) == first,
                "tier": engine.tier}

    got = outer.apply((torch.ones(1, 256),)).get()["output"]
    # Then the inner call is refused, saying why, and the outer engine serves on
    assert "would push out 'outer-m', which a running task uses" in got["inner"]
    assert got["again"] and got["tier"] == "device"
    # and once the outer task is done the inner model takes the room
    assert isinstance(inner.apply((torch.ones(1, 256),)).get()["output"], float)


def test_fp32_of_an_fp32_model_is_served_by_the_model_as_loaded(
        published: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """(``precision="fp32"`` of an fp32 checkpoint kept a second, identical copy of its
    weights in the cache, each counted against the device budget)"""
    import torch

    app = make_app(SitsConfig(), main="infer-fp32")
    app.conf.task_always_eager = True  # (apply_async with options, run here)
    loads: list[int] = []

    def linear() -> Any:
        loads.append(1)
        return torch.nn.Linear(16, 16)

    app.register_model("lin", linear, sample_inputs=(torch.ones(1, 16),))
    plan = rt.WorkerPlan("w@h", Discovery(devices=(CPU,)), (0,), 1)
    child_rt = rt.ChildRuntime(app=app, plan=plan, slot=0, device=CPU)
    monkeypatch.setattr(rt, "_child", child_rt)

    @app.inference_task(model="lin", shared=False)
    def key(engine: Any) -> str:
        return str(engine.key)

    assert key.apply().get()["output"] == "lin"
    first = key.apply_async(precision="fp32").get()
    # Then the fp32 request is served by the one entry, saying what it got
    assert first["output"] == "lin" and first["sits"]["precision"]["served"] == "fp32"
    assert child_rt.cache().warm() == {"lin": "device"}
    again = key.apply_async(precision="fp32").get()
    assert again["output"] == "lin" and again["sits"]["precision"] == \
        first["sits"]["precision"]
    assert len(loads) == 2 and child_rt.cache().warm() == {"lin": "device"}


def test_every_64_bit_seed_draws_its_own(lm: Any) -> None:
    """(seeds a multiple of 2**32 apart drew the same tokens: torch's CPU generator
    keeps the low 32 bits of its seed)"""
    def text(seed: int) -> str:
        return str(inference.generate(lm, "hi", max_new_tokens=6, temperature=1.0,
                                      seed=seed)["text"])
    assert len({text(5), text(5 + 2**32), text(5 + 2**40), text(-1), text(2**63 - 1),
                text(-2**63), text(0)}) == 7


# -- texts the tokenizer keeps nothing of, and texts too long to tokenize -----------------

@pytest.fixture
def stripping(lm: Any, encoder: Any) -> Iterator[tuple[Any, Any]]:
    """The tiny models with a tokenizer that drops whitespace (as a whitespace-splitting
    or stripping normaliser does): a prompt of spaces gives it no tokens."""
    from tokenizers import pre_tokenizers

    saved = []
    for engine in (lm, encoder):
        backend = engine.artifacts["tokenizer"].backend_tokenizer
        saved.append((backend, backend.pre_tokenizer))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
    yield lm, encoder
    for backend, pre in saved:
        backend.pre_tokenizer = pre


def test_a_prompt_of_no_tokens_is_invalid_input_alone_or_batched(
        stripping: tuple[Any, Any]) -> None:
    """(a raw torch reshape error alone; in a batch, output made of padding, or every
    call of the batch failed with that error)"""
    lm, _ = stripping
    with pytest.raises(InvalidInput, match="prompt gives no tokens with model 'lm'"):
        inference.generate(lm, "   ", max_new_tokens=3)
    calls = [batched.Call("a", ("   ",), {"max_new_tokens": 3, "stop_at_eos": False}),
             batched.Call("b", ("the worker",), {"max_new_tokens": 3}),
             batched.Call("c", ("a queue",), {"max_new_tokens": 3})]
    out = batchgen.generate_calls(lm, calls)
    assert isinstance(out[0], InvalidInput) and "no tokens" in str(out[0])
    assert [o["tokens"] for o in out[1:]] == [3, 3]


def test_a_text_of_no_tokens_is_invalid_input_not_a_zero_vector(
        stripping: tuple[Any, Any]) -> None:
    _, encoder = stripping
    with pytest.raises(InvalidInput, match="gives no tokens with model 'enc'"):
        inference.embed(encoder, ["the beat", "   "])
    out = batchembed.embed_calls(encoder, [batched.Call("a", (["   "],), {}),
                                           batched.Call("b", (["the beat"],), {})])
    assert isinstance(out[0], InvalidInput) and len(out[1]) == 1


def test_a_text_too_long_is_refused_before_it_is_tokenized(lm: Any, encoder: Any) -> None:
    """(8M characters took a soft limit's whole time in the tokenizer, which no signal
    interrupts; then the hard limit killed the child and every call batched with it)"""
    from sits_queue.workers.inputs import longest_token_chars

    huge = "x" * (64 * longest_token_chars(lm.artifacts["tokenizer"]) + 1)
    with pytest.raises(ContextTooLong, match=r"prompt of \d+ characters is longer than"):
        inference.generate(lm, huge, max_new_tokens=3)
    calls = [batched.Call("a", (huge,), {"max_new_tokens": 3}),
             batched.Call("b", ("the worker",), {"max_new_tokens": 3})]
    out = batchgen.generate_calls(lm, calls)
    assert isinstance(out[0], ContextTooLong) and out[1]["tokens"] == 3
    long_text = "y" * (kvwarm.max_positions(encoder.module, encoder.artifacts["tokenizer"])
                       * longest_token_chars(encoder.artifacts["tokenizer"]) + 1)
    out = batchembed.embed_calls(encoder, [batched.Call("a", ([long_text],), {}),
                                           batched.Call("b", (["the beat"],), {})])
    assert isinstance(out[0], ContextTooLong) and len(out[1]) == 1


def test_empty_strings_are_said_to_be_empty() -> None:
    from sits_queue.workers.inputs import check_prompt, check_texts

    with pytest.raises(InvalidInput, match="got an empty string"):
        check_prompt("", 3, 0.0)
    with pytest.raises(InvalidInput, match="item 1 is an empty string"):
        check_texts(["ok", ""])
