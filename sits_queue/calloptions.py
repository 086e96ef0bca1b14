"""One call's SITS options: from the task's declaration, the call's keywords and its
``task_routes`` entry, validated, with the time limits and the ``sits`` header the
message carries (``SitsTask.apply_async``, ``send_task`` and bulk submission share it)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from celery import Celery, Signature, Task, group
from celery.app.routes import MapRoute, Router
from celery.canvas import _chain, _chord, maybe_signature

from sits_queue.checks import shown
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.options import (
    HEADER,
    MAINTENANCE_TASKS,
    OPTION_NAMES,
    SUBMITTED_AT,
    TaskOptions,
    batch_key,
    from_header,
    header_for,
    resolve,
)
from sits_queue.timelimits import apply_class_limits

#: The SITS options a call may give as keywords (``max_batch``: batch tasks only).
CALL_OPTIONS = (*OPTION_NAMES, "max_batch")


def pop_sits_options(options: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the SITS option names from apply_async-style ``options``."""
    return {name: options.pop(name) for name in OPTION_NAMES if name in options}


class RoutedOnce(Router):  # type: ignore[misc]
    """``router`` with one call's lookup made already: Celery's ``send_task`` routes the
    message (queue, exchange, routing key) from the route the call's SITS options were
    read from. (Celery looked the route up a second time: a router that answers each
    call afresh, a round robin, gave the class of one answer and the queue of the next,
    and every task went to one queue.)"""

    def __init__(self, router: Any, route: Any) -> None:
        super().__init__(router.routes, router.queues, router.create_missing, router.app)
        self.found = route

    def lookup_route(self, *args: Any, **kwargs: Any) -> Any:
        return self.found


def routed_options(app: Celery, name: str, args: Any, kwargs: Any,
                   options: dict[str, Any]) -> None:
    """Add to a call's ``options`` the SITS options its ``task_routes`` entry gives (a
    Celery route may carry any apply_async option), under the call's own, which win as
    in Celery's merge. Read here because they are resolved before Celery routes the
    message: they were dropped without a word, an unknown class in a route included.

    The route is looked up once: ``options["router"]`` becomes a :class:`RoutedOnce`
    that hands Celery the same route. Routes do not apply to the beat's maintenance
    tasks (a glob entry, ``{"*": {"sla_class": "low"}}``, gave them its class and its
    class's time limits); :func:`~sits_queue.options.route_maintenance` places them.
    """
    router = options.get("router") or app.amqp.router
    if not router.routes or isinstance(router, RoutedOnce):
        return
    route = None
    if name not in MAINTENANCE_TASKS:
        task = app.tasks.get(name)
        # what Celery's own lookup was shown: the task's options under the call's
        seen = {k: v for k, v in task._get_exec_options().items() if v is not None} \
            if isinstance(task, Task) else {}
        route = router.lookup_route(options.get("route_name") or name, args or (),
                                    kwargs or {}, {**seen, **options}, task)
    if isinstance(route, Mapping):
        for key in CALL_OPTIONS:
            if key in route and key not in options:
                options[key] = route[key]
        # (they rode on in the message's properties, unused)
        route = {k: v for k, v in route.items() if k not in CALL_OPTIONS}
    options["router"] = RoutedOnce(router, route)


def resolve_task_options(task: Task | None, config: SitsConfig, per_call: Mapping[str, Any],
                         args: Any = (), kwargs: Any = None, name: str | None = None
                         ) -> TaskOptions:
    """Decorator defaults + per-call options, validated (``SitsTask.apply_async``'s rule);
    a task not registered here (None) declares nothing, and errors name it by ``name``.

    Raises :class:`~sits_queue.errors.InvalidTaskOptions`; nothing has been sent then.
    """
    # Celery's own checks, first: the options read the arguments (input entropy), and
    # failed on a bad shape with an error naming neither ("'list' object has no
    # attribute 'values'")
    who = getattr(task, "name", None) or name or "the task"
    if args is not None and not isinstance(args, list | tuple):
        raise TypeError(f"{who}: task args must be a list or tuple, got "
                        f"{type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{who}: task keyword arguments must be a mapping, got "
                        f"{type(kwargs).__name__}")
    declared = {name: getattr(task, name, None) for name in OPTION_NAMES}
    opts = resolve(config, declared, per_call, args, kwargs)
    most = getattr(task, "max_batch", None)
    if task is not None and most is not None and not getattr(task, "batches", False):
        # (a plain task's calls were gathered as batch kin, ahead of their turn, for a
        # run that takes them one at a time)
        raise InvalidTaskOptions(f"max_batch applies to batch tasks "
                                 f"(app.batch_inference_task); {task.name!r} declares "
                                 f"max_batch={shown(most)} but is not one")
    # a batch task: the broker may gather its kin
    if task is not None and isinstance(most, int) and most > 1:
        opts = replace(opts, batch=batch_key(task.name, opts), batch_max=most)
    return opts


def call_options(task: Task | None, config: SitsConfig, options: dict[str, Any],
                 conf: Mapping[str, Any], args: Any = (), kwargs: Any = None,
                 name: str | None = None) -> TaskOptions:
    """One call's SITS options, taken out of its apply_async-style ``options``, with the
    time limits the message carries set there (:func:`apply_class_limits`); a batch
    task's key names those limits (:func:`~sits_queue.options.batch_key`)."""
    most = options.pop("max_batch", None)
    opts = resolve_task_options(task, config, pop_sits_options(options), args, kwargs, name)
    if most is not None:
        opts = _call_max_batch(task, opts, most)
    apply_class_limits(task, config, opts.sla_class, options, conf)
    if task is not None and opts.batch is not None:
        opts = replace(opts, batch=batch_key(
            task.name, opts, (options["time_limit"], options["soft_time_limit"])))
    return opts


def hand_made_header(options: Mapping[str, Any]) -> Any:
    """The ``sits`` header a call's ``headers=`` carries (made by hand, or by an
    earlier ``apply_async``: a retry's), else None."""
    headers = options.get("headers")
    return headers.get(HEADER) if isinstance(headers, Mapping) else None


def header_options(task: Task | None, name: str, config: SitsConfig, header: Any,
                   options: dict[str, Any], conf: Mapping[str, Any]) -> TaskOptions:
    """A call's options read from its hand-made ``header``: checked (an unknown class or
    an impossible ``vram_gib`` refused at the call, not met by every worker; a header
    that is no object not replaced silently by the defaults), refused beside keyword
    options (which would go unchecked and unused), its class's time limits set in
    ``options`` as a keyword class's are (``send_task``, ``enqueue_many``)."""
    opts = from_header(config, header)
    if given := sorted(k for k in CALL_OPTIONS if k in options):
        raise InvalidTaskOptions(
            f"task {name}: SITS options both in a hand-made {HEADER!r} header and as "
            f"keywords ({', '.join(given)}); give them one way")
    # (a pair given beside it is checked as apply_async's keywords are: -5, "x", a soft
    # limit past the hard one were sent as given)
    apply_class_limits(task, config, opts.sla_class, options, conf)
    return opts


def _call_max_batch(task: Task | None, opts: TaskOptions, most: Any) -> TaskOptions:
    """A batch task's call with ``max_batch=N``: it leads batches of at most N tasks, and
    with 1 it runs alone (no batch key: no other batch takes it either; a shard of
    :func:`~sits_queue.shards.apply_sharded` is a batch of items already)."""
    declared = getattr(task, "max_batch", None)
    if not isinstance(declared, int) or declared <= 1 or opts.batch is None:
        raise InvalidTaskOptions(f"max_batch applies to batch tasks "
                                 f"(app.batch_inference_task); {getattr(task, 'name', task)!r} "
                                 "is not one")
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= declared:
        raise InvalidTaskOptions(f"max_batch must be an integer in [1, {declared}] (the task's "
                                 f"own), got {shown(most)}")
    if most == 1:
        return replace(opts, batch=None, batch_max=None)
    return replace(opts, batch_max=most)


def sits_headers(config: SitsConfig, opts: TaskOptions, headers: Mapping[str, Any] | None,
                 now_s: float) -> dict[str, Any]:
    """The caller's headers plus the ``sits`` options header (``opts``, resolved under
    ``config``) and the submission time."""
    out = dict(headers or {})
    out[HEADER] = header_for(config, opts)
    out[SUBMITTED_AT] = now_s
    return out


def leaves(sig: Any) -> Iterator[Signature]:
    """The task signatures a canvas sends: a chain's steps, a group's members, a chord's
    header and body, recursively."""
    if isinstance(sig, _chord):
        yield from leaves(sig.tasks)
        yield from leaves(sig.body)
    elif isinstance(sig, group | _chain):
        yield from leaves(sig.tasks)
    elif isinstance(sig, list | tuple):
        for member in sig:
            yield from leaves(member)
    elif isinstance(sig, Signature):
        yield sig


def sends_later(options: Mapping[str, Any], link: Any, link_error: Any) -> bool:
    """Whether a call carries a canvas a worker sends on later (:func:`check_later_steps`)."""
    return bool(options.get("chain") or options.get("chord") or link or link_error)


def check_later_steps(app: Celery, config: SitsConfig, options: Mapping[str, Any],
                      link: Any = None, link_error: Any = None) -> None:
    """What a submission sends later, from a worker (a chain's next steps, a chord's body,
    callbacks and errbacks, theirs too), checked now by the rule its first step's options
    are: a later step's unknown class or a ``vram_gib`` past its class's limit was heard
    only when the worker sent that step on, where the chain stopped and the step before
    it, which had succeeded, was marked failed. A step of a task this app does not
    register is checked for what does not depend on its declaration (the worker's
    declares its class and whether it batches: a ``vram_gib`` is weighed only against a
    class the step names). What a running task carries on from its own request (the
    rest of its chain and its chord, which ``replace`` and ``add_to_chord`` send with
    the replacement; its producer's, of another class table maybe) is left to be sent
    on as it came. Where the app has a route that is a function, later steps are checked
    when they are sent (a function's answer may differ from call to call: a round
    robin's would move on).

    Raises :class:`~sits_queue.errors.InvalidTaskOptions` naming the step; nothing has
    been sent then."""
    if not sends_later(options, link, link_error) or \
            not all(isinstance(route, MapRoute) for route in app.amqp.router.routes):
        return
    chord = options.get("chord")
    group_id = options.get("group_id")
    if chord is not None and group_id is not None:
        # (each task of a chord's header carries the same body, and the group's id)
        seen = _checked_chord.get(app)
        if seen is not None and seen[0] == group_id and seen[1]() is chord:
            chord = None
    carried = carried_ids(app).every  # (none outside a worker)
    for later in (options.get("chain"), chord, link, link_error):
        for leaf in _leaves_and_callbacks(app, _signatures(app, later), set()):
            if leaf.options.get("task_id") not in carried:
                _check_step(app, config, leaf)
    if chord is not None and group_id is not None:
        # (a chord a running task's request carries is a dict: no memo; its member's
        # replace failed on the weak reference, and its chord with it)
        with contextlib.suppress(TypeError):
            _checked_chord[app] = (group_id, weakref.ref(chord))


#: Per app, the chord body checked last and its group's id.
_checked_chord: weakref.WeakKeyDictionary[Celery, tuple[Any, weakref.ref[Any]]] = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Carried:
    """The task ids a running task's request carries on: the rest of its chain, its
    chord's body (its steps or members), and both."""

    chain: frozenset[str]
    chord: frozenset[str]

    @property
    def every(self) -> frozenset[str]:
        return self.chain | self.chord


_NONE_CARRIED = Carried(frozenset(), frozenset())


def carried_ids(app: Celery) -> Carried:
    """:class:`Carried` of the task running in this worker (none outside one), read once
    per request. A chain or chord Celery cannot rebuild here (a canvas type this worker
    does not know) carries none: the sends it did not mean are not failed for it."""
    running = app.current_worker_task
    request = getattr(running, "request", None)
    if request is None:
        return _NONE_CARRIED
    known = getattr(request, "_sits_carried", None)
    if isinstance(known, Carried):
        return known
    try:
        carried = Carried(_ids(app, request.chain or []), _ids(app, request.chord))
    except (TypeError, ValueError, KeyError, AttributeError):
        carried = _NONE_CARRIED
    request._sits_carried = carried
    return carried


def _ids(app: Celery, sent: Any) -> frozenset[str]:
    return frozenset(task_id for leaf in leaves(_signatures(app, sent))
                     if isinstance(task_id := leaf.options.get("task_id"), str))


def _check_step(app: Celery, config: SitsConfig, leaf: Signature) -> None:
    given = dict(leaf.options)
    if hand_made_header(given) is not None:
        return  # (checked at its send, as send_task checks one)
    for sent_with_it in ("router", "link", "link_error", "chain", "chord"):
        given.pop(sent_with_it, None)
    routed_options(app, leaf.task, leaf.args, leaf.kwargs, given)
    task = app.tasks.get(leaf.task)
    if task is None:
        given.pop("max_batch", None)
        if given.get("sla_class") is None:
            given.pop("vram_gib", None)
    try:
        call_options(task, config, given, app.conf, leaf.args, leaf.kwargs, leaf.task)
    except InvalidTaskOptions as exc:
        raise InvalidTaskOptions(f"{leaf.task}, a later step of this call (a chain's "
                                 f"next, a chord's body or a callback): {exc}") from exc


def _leaves_and_callbacks(app: Celery, sig: Any, seen: set[int]) -> Iterator[Signature]:
    """:func:`leaves`, and the leaves of each one's own ``link`` and ``link_error``, each
    once (a signature linked to itself is no loop here)."""
    for leaf in leaves(sig):
        if id(leaf) in seen:
            continue
        seen.add(id(leaf))
        yield leaf
        for name in ("link", "link_error"):
            if callbacks := leaf.options.get(name):
                yield from _leaves_and_callbacks(app, _signatures(app, callbacks), seen)


def _signatures(app: Celery, sent: Any) -> Any:
    """``sent`` (a signature, its dict from a message, or a list of either) as canvas
    objects."""
    if isinstance(sent, list | tuple):
        return [_signatures(app, each) for each in sent]
    return None if sent is None else maybe_signature(sent, app=app)
