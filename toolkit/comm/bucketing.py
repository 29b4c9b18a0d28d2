"""DDP gradient bucketing: all-reduce overlapped with backward, and why the bucket size has an optimum.

DDP groups gradients into buckets of about ``bucket_cap_mb`` (in the reverse order backward produces
them) and all-reduces a bucket as soon as its last gradient is ready, while backward goes on::

    backward   ──── head ─── block 3 ─── block 2 ─── block 1 ─── block 0 ─── embed ┐ (last grad ready)
    link           [ b0 ]      [  b1  ]    [  b2  ]    [  b3  ]    [  b4  ] [ b5 ]───┤ exposed
                                                                                      ▼ step can go on

    one bucket's time on the link = its all-reduce's time: α + 2(n-1)/n · S_b / β in the simplest model
    (``alpha_beta``: latency per call + ring bytes / bandwidth); the emulated cluster's is NCCL's, calibrated
    (``toolkit.runtime.collectives.seconds``)
    it starts at max(its gradients ready, the previous bucket done): the link carries one at a time

Small buckets pay α (and DDP's per-bucket work) once per bucket: many calls, the link busy with
latency. One huge bucket starts only when backward has ended: nothing overlaps and the whole
all-reduce is exposed. In between, most of the transfer hides behind backward and the last bucket,
the only one that must be exposed, is small.

On a CPU machine the all-reduce over loopback (gloo) costs CPU time on the same cores that run
backward, so little can overlap and the latency per call is small: the curve is flat and noisy. On the
emulated cluster (``launch(..., cluster=)``, ``toolkit.runtime.emulator``) DDP's buckets go through
``ctx.emulator.ddp_hook``: each all-reduce is timed on the virtual clock by the link the ranks span, as a
GPU cluster's NCCL and NIC move the bytes without the compute cores. ``simulate`` is the closed form of
the same link, fed the times at which buckets became ready; ``steady_exposed`` assumes a steady rate.
"""
from __future__ import annotations

import itertools
from typing import Callable

TransferTime = Callable[[float], float]
"""Seconds of one all-reduce on the link, from the bytes each rank puts on it (``ring_bytes``)."""


def ring_bytes(nbytes: int, n: int) -> float:
    """Bytes each rank puts on the link for an all-reduce of ``nbytes`` over ``n`` ranks (ring)."""
    return 2 * (n - 1) / n * nbytes


def alpha_beta(alpha_s: float, beta: float) -> TransferTime:
    """The simplest link: ``alpha_s`` per call plus the bytes over ``beta`` (bytes per second)."""
    return lambda wire_bytes: alpha_s + wire_bytes / beta


def simulate(ready_s: list[float], nbytes: list[float], n: int, transfer_s: TransferTime) -> list[float]:
    """End time of each bucket's all-reduce on a link that carries one at a time (same clock as ``ready_s``)."""
    ends, free = [], float("-inf")
    for ready, b in zip(ready_s, nbytes):
        free = max(ready, free) + transfer_s(ring_bytes(b, n))
        ends.append(free)
    return ends


def steady_exposed(bucket_bytes: list[float], backward_s: float, n: int, transfer_s: TransferTime) -> float:
    """Exposed all-reduce time (after backward ends) of ``simulate``'s link, gradients produced at a steady rate.

    Bucket ``i`` (in ready order) is ready once backward has produced its bytes and those of the buckets before
    it, so the result depends on the bucket layout and the link only, not on a run's timing noise.
    """
    total = sum(bucket_bytes)
    ready = list(itertools.accumulate(b / total * backward_s for b in bucket_bytes))
    return max(simulate(ready, bucket_bytes, n, transfer_s)) - backward_s
