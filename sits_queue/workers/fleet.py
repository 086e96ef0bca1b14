"""A worker's place in its fleet, for picks: how its devices compare with every live
worker's, as affinity weights (``broker/affinity.py``).

Two comparisons, both read from the workers' advertised device records
(``advertise.device_record``), never from another worker's children:

* precisions (§3.2): each precision's datasheet peak against the fleet's
  (``affinity.precision_weights``);
* the roofline (§3.1): the device's ridge point (peak FLOP/s over bandwidth, per
  precision) against the fleet's (``affinity.roofline_weights``).

A fleet's make-up changes when workers come and go, not per task: read every
:data:`FleetWeights.MAX_AGE_S`, and sooner when the workers that refreshed their
advertisement within its TTL are others than at the last reading, or one of them moved
queues (one ``ZRANGEBYSCORE`` and a counter's ``GET`` every :data:`FleetWeights.PROBE_S`:
the first worker of a fleet to pick saw a fleet of one, and matched nothing for half a
minute; a worker killed was weighed against for as long). A Redis error keeps the last
weights.

A worker's fleet is the live workers it competes with for tasks: those consuming one of
its queues (:func:`peers`; its advertisement says which, ``queues``). Two pools of GPUs
behind different queues are not weighed against each other: an H200 alone on its queue
beside L4s on another's is not "rich in bandwidth" for any task it can take.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from sits_queue.broker import affinity
from sits_queue.checks import is_positive
from sits_queue.options import PRECISIONS

logger = logging.getLogger(__name__)


def device_peaks(record: Mapping[str, Any]) -> dict[str, float]:
    """A worker record's peak TFLOP/s per precision, the best of its devices."""
    peaks: dict[str, float] = {}
    for device in _devices(record):
        for precision, value in _peaks_of(device).items():
            peaks[precision] = max(peaks.get(precision, 0.0), value)
    return peaks


def device_ridges(record: Mapping[str, Any]) -> dict[str, float]:
    """A worker record's ridge points, FLOP/byte, per precision a task may ask for, at
    the precision it is served at there (int8 at fp16 on a GPU: ``precision.first_choice``):
    one device's, its best (the highest fp16 peak, then bandwidth; a device's peaks
    over another's bandwidth made a ridge neither has). Empty where no device has a
    bandwidth and peaks (a CPU, a GPU missing from the datasheet table)."""
    from sits_queue.cache.precision import first_choice  # (light: no torch)

    best: tuple[float, float] | None = None
    ridges: dict[str, float] = {}
    where = "cpu"
    for device in _devices(record):
        peaks, bandwidth = _peaks_of(device), device.get("bandwidth_gb_s")
        if not peaks or not is_positive(bandwidth):
            continue
        rank = (peaks.get(affinity.DEFAULT_PRECISION, max(peaks.values())), float(bandwidth))
        if best is None or rank > best:
            best, ridges = rank, affinity.ridge_points(peaks, float(bandwidth))
            where = "cuda" if device.get("kind") == "cuda" else "cpu"
    if not ridges:
        return {}
    served = {p: first_choice(p, where)[0] for p in PRECISIONS}
    return {p: ridges[s] for p, s in served.items() if s in ridges}


def _devices(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    devices = record.get("devices")
    return [d for d in (devices if isinstance(devices, list) else [])
            if isinstance(d, Mapping)]


def _peaks_of(device: Mapping[str, Any]) -> dict[str, float]:
    """One advertised device's peak TFLOP/s per precision (those that are figures)."""
    table = device.get("peak_tflops")
    return {str(p): float(v) for p, v in (table.items() if isinstance(table, Mapping)
                                          else ()) if is_positive(v)}


def consumed(record: Mapping[str, Any]) -> frozenset[str] | None:
    """The queues a worker record says its worker consumes; None where it does not say
    (an earlier release's record)."""
    queues = record.get("queues")
    if not isinstance(queues, list):
        return None
    return frozenset(q for q in queues if isinstance(q, str))


def peers(own: Mapping[str, Any], fleet: Sequence[Mapping[str, Any]]
          ) -> list[Mapping[str, Any]]:
    """The records of ``fleet`` whose workers compete with ``own``'s for tasks: those
    consuming a queue it consumes, and those whose record does not say (an earlier
    release's, in a fleet upgraded host by host: counted, as it was). Every one where
    ``own`` does not say."""
    mine = consumed(own)
    if mine is None:
        return list(fleet)
    return [r for r in fleet if (theirs := consumed(r)) is None or theirs & mine]


@dataclass(frozen=True)
class Standing:
    """This worker's fleet weights: per precision, and its roofline."""

    precisions: Mapping[str, float] = field(default_factory=dict)
    roofline: affinity.Roofline = affinity.NO_ROOFLINE
    #: On a host of unlike GPUs, each device's own roofline (by UUID), for the picks of
    #: its children alone (``warmreader.py``); empty on a host of one kind.
    devices: Mapping[str, affinity.Roofline] = field(default_factory=dict)
    #: On a host of unlike GPUs, each device's own precision weights (by UUID; a device
    #: strong at none: empty), as :attr:`devices`; empty on a host of one kind.
    device_precisions: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def placement_record(standing: Standing) -> dict[str, Any]:
    """A :class:`Standing` as the worker's advertisement carries it (``sitsq status``)."""
    record: dict[str, Any] = {"precisions": dict(standing.precisions),
                              "bounds": dict(standing.roofline.bounds),
                              "ridges": dict(standing.roofline.ridges)}
    devices: dict[str, dict[str, Any]] = {}
    for uuid, r in standing.devices.items():
        devices[uuid] = {"bounds": dict(r.bounds), "ridges": dict(r.ridges)}
    for uuid, weights in standing.device_precisions.items():
        devices.setdefault(uuid, {})["precisions"] = dict(weights)
    if devices:
        record["devices"] = devices
    return record


def standing(own: Mapping[str, Any], fleet: Sequence[Mapping[str, Any]],
             policy: affinity.AffinityPolicy) -> Standing:
    """This worker's :class:`Standing` from its own record and every live worker's
    (own included), weighed against its :func:`peers`: each kind of device a peer has
    once (:func:`kind_ridges`; a worker of one kind, one), so that the two GPUs of a
    host of an H200 and an L4 are an H200 and an L4 of the fleet."""
    rivals = peers(own, fleet)
    strength = policy.precision_weight
    precisions = affinity.precision_weights(
        device_peaks(own), [device_peaks(r) for r in rivals], strength) \
        if strength > 0 else {}
    by_device = _each_device_precisions(
        _devices(own), [kind for r in rivals for kind in kind_peaks(r)], strength) \
        if strength > 0 and len(kind_peaks(own)) > 1 else {}
    ridges = device_ridges(own)
    if policy.roofline_weight <= 0 or not ridges:
        return Standing(precisions, affinity.Roofline(ridges, {}),
                        device_precisions=by_device)
    weight = policy.roofline_weight
    theirs = [kind for r in rivals for kind in kind_ridges(r)]
    devices = _each_device(_devices(own), theirs, weight) if len(kind_ridges(own)) > 1 \
        else {}
    return Standing(precisions, affinity.Roofline(ridges, _bounds(ridges, theirs, weight)),
                    devices, by_device)


def kind_peaks(record: Mapping[str, Any]) -> list[dict[str, float]]:
    """A worker record's peak TFLOP/s per precision (:func:`_peaks_of`) per kind of device
    it has, each kind once (as :func:`kind_ridges`); none for a device without figures."""
    return _each_kind(record, _peaks_of)


def _each_device_precisions(devices: Sequence[Mapping[str, Any]],
                            theirs: Sequence[Mapping[str, float]], weight: float
                            ) -> dict[str, dict[str, float]]:
    """Each of ``devices``' (advertised records) precision weights against ``theirs``
    (peaks per kind of device), by UUID; one without datasheet figures has none."""
    return {str(d.get("uuid")): affinity.precision_weights(p, theirs, weight)
            for d in devices if (p := _peaks_of(d))}


def kind_ridges(record: Mapping[str, Any]) -> list[dict[str, float]]:
    """A worker record's ridge points (:func:`device_ridges`) per kind of device it has,
    each kind once: one entry for a worker of one kind of GPU however many it has, two
    for a host of an H200 and an L4; none for a CPU."""
    return _each_kind(record, lambda device: device_ridges({"devices": [device]}))


def _each_kind(record: Mapping[str, Any],
               figures: Callable[[Mapping[str, Any]], dict[str, float]]
               ) -> list[dict[str, float]]:
    """``figures`` of each of a record's devices, each distinct one once (a kind of
    device), leaving out devices without any."""
    kinds: list[dict[str, float]] = []
    for device in _devices(record):
        if (found := figures(device)) and found not in kinds:
            kinds.append(found)
    return kinds


def _each_device(devices: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, float]],
                 weight: float) -> dict[str, affinity.Roofline]:
    """Each of ``devices``' (advertised records) roofline against ``theirs``, by UUID;
    one without datasheet figures has none."""
    return {str(d.get("uuid")): affinity.Roofline(r, _bounds(r, theirs, weight))
            for d in devices if (r := device_ridges({"devices": [d]}))}


def _bounds(ridges: Mapping[str, float], theirs: Sequence[Mapping[str, float]],
            weight: float) -> dict[str, float]:
    """The bound weights (:func:`affinity.bound_key` -> weight) of a device of ``ridges``
    against ``theirs`` (its own included), each at the precision tasks ask for."""
    bounds: dict[str, float] = {}
    for precision, ridge in ridges.items():
        for bound, w in affinity.roofline_weights(
                ridge, [r.get(precision) for r in theirs], weight).items():
            bounds[affinity.bound_key(bound, precision)] = w
    return bounds


def host_rooflines(devices: Sequence[Mapping[str, Any]], weight: float
                   ) -> dict[str, affinity.Roofline]:
    """Each of one worker's devices' roofline against its others' (advertised device
    records, ``advertise.device_record``; by UUID), for which of its children runs a
    task that declares its ``arithmetic_intensity`` (``steer.py``): the worker's picks
    weigh its best device against the fleet (:func:`standing`), and on a host of unlike
    GPUs a decode step taken for its H200 went to whichever child was idle, the L4's as
    well. As :func:`standing` weighs the fleet: by ridge point against the geometric
    mean of the host's kinds of device, each kind once. A host of one kind, or of
    devices without datasheet figures, weighs nothing (an empty map)."""
    if weight <= 0:
        return {}
    theirs = kind_ridges({"devices": list(devices)})
    return {uuid: r for uuid, r in _each_device(devices, theirs, weight).items() if r.bounds}


def host_precisions(devices: Sequence[Mapping[str, Any]], weight: float
                    ) -> dict[str, dict[str, float]]:
    """Each of one worker's devices' precision weights against its others' (by UUID), for
    which of its children runs a task that asks for a precision (``steer.py``), as
    :func:`host_rooflines` weighs bounds: an fp8 task taken for the H100 of a host with
    an A100 went to whichever child was idle, the A100's as well (where fp8 runs at
    fp16's rate). A host of one kind, or where no device is relatively stronger at any
    precision, weighs nothing (an empty map)."""
    theirs = kind_peaks({"devices": list(devices)})
    if weight <= 0 or len(theirs) < 2:
        return {}
    found = _each_device_precisions(devices, theirs, weight)
    return found if any(found.values()) else {}


class FleetWeights:
    """Worker main process: its :class:`Standing`, read again every :data:`MAX_AGE_S`,
    or at the next call after the live workers changed."""

    #: How often the fleet's devices are read again at the most, s.
    MAX_AGE_S = 30.0
    #: How often who is live is looked at, s.
    PROBE_S = 2.0

    def __init__(self, policy: affinity.AffinityPolicy,
                 read: Callable[[], tuple[Mapping[str, Any] | None, Sequence[Mapping[str, Any]]]],
                 members: Callable[[], Hashable], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        """``read``: this worker's own record (None while it has none) and, where it
        asks, every live worker's; ``members``: who is live now and on which queues,
        cheaply (a change of it reads the fleet again). Both raise ``redis.RedisError``
        when Redis fails."""
        self._policy = policy
        self._read = read
        self._members = members
        self._clock = clock
        self._at: float | None = None
        self._probed_at: float | None = None
        #: Who was live as the last reading began; None: read again at the probe.
        self._seen: Hashable | None = None
        self._standing = Standing()

    @property
    def current(self) -> Standing:
        """The last reading's weights, without reading."""
        return self._standing

    def __call__(self) -> Standing:
        policy = self._policy
        if policy.precision_weight <= 0 and policy.roofline_weight <= 0:
            return self._standing
        now = self._clock()
        if self._at is not None and now - self._at < self.MAX_AGE_S:
            if self._probed_at is not None and now - self._probed_at < self.PROBE_S:
                return self._standing
            self._probed_at = now
            try:
                if self._seen is not None and self._members() == self._seen:
                    return self._standing
            except redis.RedisError as exc:
                logger.debug("worker registry unreadable, fleet weights kept: %s", exc)
                return self._standing
        self._at = self._probed_at = now
        try:
            seen = self._members()  # (before the read: a worker joining now is not missed)
            own, fleet = self._read()
        except redis.RedisError as exc:  # keep the last weights
            logger.debug("fleet unreadable, fleet weights kept: %s", exc)
            return self._standing
        # (this worker's own record not written yet: read again at the next probe)
        self._seen = seen if own is not None else None
        self._standing = standing(own or {}, fleet, policy)
        return self._standing
