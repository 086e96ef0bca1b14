"""What a submission sends later from a worker (a chain's next steps, a chord's body,
callbacks) is checked at submission by the first step's rule
(``calloptions.check_later_steps``): a bad class there was heard only when the worker
sent the step on, the chain stopped, and the step before it was marked failed.
No broker is reached: a refused call sends nothing, a passing one is checked directly."""

from __future__ import annotations

from typing import Any

import pytest
from celery import chain, chord, group, signature

from sits_queue.app import make_app, sits_config
from sits_queue.calloptions import check_later_steps
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions

DEAD_BROKER = "redis://127.0.0.1:1/0"  # (nothing listens: a send would fail to connect)


def _app(**conf: Any) -> Any:
    app = make_app(SitsConfig(redis_url=DEAD_BROKER), main="later-steps-unit")
    app.conf.update(conf)

    @app.task(name="u.add", shared=False)
    def add(x: int, y: int = 0) -> int:
        return x + y

    @app.task(name="u.total", shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    return app


@pytest.mark.parametrize("later", [
    pytest.param(lambda add, total: dict(steps=chain(add.s(1, 1), add.s(2),
                                                     add.s(3).set(sla_class="bogus"))),
                 id="chain's third step"),
    pytest.param(lambda add, total: dict(steps=chain(add.s(1, 1),
                                                     group(add.s(2), add.s(3).set(
                                                         sla_class="bogus")))),
                 id="a group's member in a chain"),
    pytest.param(lambda add, total: dict(first=add, link=add.s(5).set(sla_class="bogus")),
                 id="link"),
    pytest.param(lambda add, total: dict(first=add, link_error=[add.si(1), add.si(2).set(
        sla_class="bogus")]), id="one errback of two"),
])
def test_a_later_step_of_an_unknown_class_is_refused_at_submission(later: Any) -> None:
    app = _app()
    call = later(app.tasks["u.add"], app.tasks["u.total"])
    with pytest.raises(InvalidTaskOptions, match=r"u\.add, a later step of this call .*"
                                                 r"unknown sla_class 'bogus'"):
        if "steps" in call:
            call["steps"].apply_async()
        else:
            call["first"].apply_async((1, 1), link=call.get("link"),
                                      link_error=call.get("link_error"))


def test_a_later_steps_vram_past_its_class_and_a_chords_body_are_refused() -> None:
    app = _app()
    add, total = app.tasks["u.add"], app.tasks["u.total"]
    with pytest.raises(InvalidTaskOptions, match=r"vram_gib 100 exceeds the 'low' class"):
        chain(add.s(1, 1), add.s(2).set(sla_class="low", vram_gib=100)).apply_async()
    config = sits_config(app)
    body = total.s().set(sla_class="bogus")
    # (what chord.run hands each header task: the body rides along as its ``chord``)
    with pytest.raises(InvalidTaskOptions, match=r"u\.total, a later step"):
        add.apply_async((1, 2), chord=body)
    with pytest.raises(InvalidTaskOptions, match=r"u\.total, a later step"):
        check_later_steps(app, config, {"chord": dict(body)})  # (as a message carries it)


def test_a_step_sent_by_name_is_checked_by_send_task_too() -> None:
    app = _app()
    with pytest.raises(InvalidTaskOptions, match=r"elsewhere\.step, a later step"):
        app.send_task("elsewhere.first", (1,),
                      chain=[signature("elsewhere.step", app=app).set(sla_class="bogus")])


def test_later_steps_of_good_options_and_a_routes_class_pass() -> None:
    """(a step's class may come from its route: 40 GiB is past the default "medium"'s 32
    but within the routed "high")"""
    app = _app(task_routes={"u.total": {"sla_class": "high"}})
    add, total = app.tasks["u.add"], app.tasks["u.total"]
    config = sits_config(app)
    steps = [add.s(2).set(sla_class="medium"), total.s().set(vram_gib=40),
             chord([add.s(1), add.s(2)], total.s())]
    check_later_steps(app, config, {"chain": steps, "chord": total.s()},
                      link=add.s(1), link_error=[add.si(1)])
    with pytest.raises(InvalidTaskOptions, match="vram_gib 40 exceeds the 'medium'"):
        check_later_steps(app, config, {"chain": [add.s(2).set(vram_gib=40)]})


def test_a_route_that_is_a_function_leaves_later_steps_to_their_send() -> None:
    """(a function may answer each call afresh: asked once more here, a round robin's
    next answer would have moved on)"""
    asked: list[str] = []

    def route(name: str, *args: Any, **kwargs: Any) -> dict[str, str]:
        asked.append(name)
        return {"sla_class": "high"}

    app = _app(task_routes=(route,))
    config = sits_config(app)
    check_later_steps(app, config, {"chain": [app.tasks["u.add"].s(1).set(sla_class="bogus")]})
    assert asked == []


def test_a_hand_made_header_on_a_later_step_is_left_to_its_send() -> None:
    app = _app()
    step = app.tasks["u.add"].s(1).set(headers={"sits": {"sla_class": "high"}})
    check_later_steps(app, sits_config(app), {"chain": [step]})


def test_a_step_of_a_task_not_registered_here_is_checked_for_what_its_call_names() -> None:
    """(its declaration is the worker's: the default class's vram limit, and "not a batch
    task", refused steps the worker would send)"""
    app = _app()
    config = sits_config(app)
    check_later_steps(app, config, {"chain": [
        signature("remote.batch", app=app).set(max_batch=4),
        signature("remote.big", app=app).set(vram_gib=60)]})
    with pytest.raises(InvalidTaskOptions, match=r"remote\.big, a later step .* vram_gib 60 "
                                                 r"exceeds the 'medium' class"):
        check_later_steps(app, config, {"chain": [
            signature("remote.big", app=app).set(vram_gib=60, sla_class="medium")]})
    with pytest.raises(InvalidTaskOptions, match=r"remote\.x, a later step .* sla_class"):
        check_later_steps(app, config, {"chain": [
            signature("remote.x", app=app).set(sla_class="bogus")]})


def test_a_later_steps_own_callbacks_are_checked_and_the_calls_own_error_comes_first(
        ) -> None:
    app = _app()
    add = app.tasks["u.add"]
    errback = add.si(1).set(sla_class="bogus")
    with pytest.raises(InvalidTaskOptions, match=r"u\.add, a later step .* 'bogus'"):
        chain(add.s(1, 1), add.s(2).on_error(errback)).apply_async()
    with pytest.raises(InvalidTaskOptions, match=r"^unknown sla_class 'typo'"):
        chain(add.s(1, 1).set(sla_class="typo"), add.s(2).set(sla_class="bogus")).apply_async()


def test_bulk_submissions_callbacks_are_checked_before_anything_is_sent() -> None:
    from sits_queue.broker.bulk import enqueue_many

    app = _app()
    with pytest.raises(InvalidTaskOptions, match=r"u\.total, a later step"):
        enqueue_many(app.tasks["u.add"], [(1, 2)],
                     link=app.tasks["u.total"].s().set(sla_class="bogus"))


def test_what_a_running_task_carries_on_is_left_to_be_sent_on_as_it_came() -> None:
    """(``replace`` and ``add_to_chord`` send the running request's chain and chord on
    with what they send: its producer's, of another class table maybe, were checked
    against this worker's and refused)"""
    from celery._state import _task_stack

    app = _app()
    config = sits_config(app)
    add, total = app.tasks["u.add"], app.tasks["u.total"]
    step = add.s(2).set(sla_class="producers")
    step.freeze()
    body = total.s().set(sla_class="producers")
    body.freeze()
    add.push_request(id="r-1", called_directly=False, chain=[dict(step)], chord=dict(body))
    _task_stack.push(add)
    try:
        check_later_steps(app, config, {"chain": [signature(dict(step), app=app)],
                                        "chord": signature(dict(body), app=app)})
        # what the task's own code adds is checked
        with pytest.raises(InvalidTaskOptions, match="unknown sla_class 'typo'"):
            check_later_steps(app, config, {"chain": [add.s(3).set(sla_class="typo"),
                                                      signature(dict(step), app=app)]})
    finally:
        _task_stack.pop()
        add.pop_request()


def test_a_signature_linked_to_itself_is_checked_once() -> None:
    app = _app()
    add = app.tasks["u.add"]
    looped = add.si(1)
    looped.link(looped)
    check_later_steps(app, sits_config(app), {}, link=looped)
