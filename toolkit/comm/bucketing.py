"""DDP gradient bucketing: all-reduce overlapped with backward, and why the bucket size has an optimum.

DDP groups gradients into buckets of about ``bucket_cap_mb`` (in the reverse order backward produces
them) and all-reduces a bucket as soon as its last gradient is ready, while backward goes on::

    backward   ──── head ─── block 3 ─── block 2 ─── block 1 ─── block 0 ─── embed ┐ (last grad ready)
    link           [ b0 ]      [  b1  ]    [  b2  ]    [  b3  ]    [  b4  ] [ b5 ]───┤ exposed
                                                                                      ▼ step can go on

    one bucket's time on the link = α + 2(n-1)/n · S_b / β        (latency per call + ring bytes / bandwidth)
    it starts at max(its gradients ready, the previous bucket done): the link carries one at a time

Small buckets pay α (and DDP's per-bucket work) once per bucket: many calls, the link busy with
latency. One huge bucket starts only when backward has ended: nothing overlaps and the whole
all-reduce is exposed. In between, most of the transfer hides behind backward and the last bucket,
the only one that must be exposed, is small.

On a CPU machine the all-reduce over loopback (gloo) costs CPU time on the same cores that run
backward, so little can overlap and the latency per call is small: the curve is flat and noisy.
``LinkEmulator`` is a DDP comm hook that does the real all-reduce and completes its future no earlier
than a link of latency ``alpha_s`` and bandwidth ``beta`` (bytes/s) would: the transfer then takes
time without taking the CPU, as on a GPU cluster where NCCL and the NIC move the bytes. Its numbers are
those of the emulated link, labelled as such; ``simulate`` is the closed form of the same link, fed
with the measured times at which buckets became ready.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time

import torch
import torch.distributed as dist


def ring_bytes(nbytes: int, n: int) -> float:
    """Bytes each rank puts on the link for an all-reduce of ``nbytes`` over ``n`` ranks (ring)."""
    return 2 * (n - 1) / n * nbytes


def simulate(ready_s: list[float], nbytes: list[int], n: int, alpha_s: float, beta: float) -> list[float]:
    """End time of each bucket's all-reduce on a link that carries one at a time (same clock as ``ready_s``)."""
    ends, free = [], float("-inf")
    for ready, b in zip(ready_s, nbytes):
        free = max(ready, free) + alpha_s + ring_bytes(b, n) / beta
        ends.append(free)
    return ends


def steady_exposed(bucket_bytes: list[int], backward_s: float, n: int, alpha_s: float, beta: float) -> float:
    """Exposed all-reduce time (after backward ends) of ``simulate``'s link, gradients produced at a steady rate.

    Bucket ``i`` (in ready order) is ready once backward has produced its bytes and those of the buckets before
    it, so the result depends on the bucket layout and the link only, not on a run's timing noise.
    """
    total = sum(bucket_bytes)
    ready = list(itertools.accumulate(b / total * backward_s for b in bucket_bytes))
    return max(simulate(ready, bucket_bytes, n, alpha_s, beta)) - backward_s


class _Timer:
    """Completes futures at given times, on one background thread."""

    def __init__(self):
        self.heap: list = []
        self.cv = threading.Condition()
        self.seq = 0
        threading.Thread(target=self._loop, daemon=True, name="link-emulator").start()

    def at(self, when: float, fut: torch.futures.Future, value) -> None:
        with self.cv:
            self.seq += 1
            heapq.heappush(self.heap, (when, self.seq, fut, value))
            self.cv.notify()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.heap:
                    self.cv.wait()
                when, _, fut, value = self.heap[0]
                delay = when - time.perf_counter()
                if delay > 0:
                    self.cv.wait(timeout=delay)
                    continue
                heapq.heappop(self.heap)
            fut.set_result(value)


class LinkEmulator:
    """A DDP comm hook: ``model.register_comm_hook(None, emulator.hook)``.

    Every bucket is averaged with a real ``all_reduce`` (async, so the ledger counts it); the future DDP
    waits on completes at ``max(real completion, emulated end)``, where the emulated link starts a bucket
    when it is ready and the previous one is done, and takes ``alpha_s + ring bytes / beta``. With
    ``beta = inf`` and ``alpha_s = 0`` it is DDP's plain ``allreduce_hook``. ``spans`` records, per bucket,
    (index, ready, link start, link end, bytes) on ``time.perf_counter``'s clock.
    """

    def __init__(self, alpha_s: float = 0.0, beta: float = float("inf"), group=None):
        self.alpha_s, self.beta, self.group = alpha_s, beta, group
        self.n = dist.get_world_size(group)
        self.link_free = 0.0
        self.spans: list[dict] = []
        self.emulated = alpha_s > 0 or beta != float("inf")
        self._timer = _Timer() if self.emulated else None

    def hook(self, state, bucket):  # no annotations: DDP checks them against Future[Tensor] objects
        t = bucket.buffer()
        t.div_(self.n)
        ready = time.perf_counter()
        nbytes = t.numel() * t.element_size()
        start = max(ready, self.link_free)
        end = start + self.alpha_s + ring_bytes(nbytes, self.n) / self.beta if self.emulated else ready
        self.link_free = end
        self.spans.append({"bucket": bucket.index(), "ready": ready, "start": start, "end": end, "bytes": nbytes})
        real = dist.all_reduce(t, group=self.group, async_op=True).get_future()
        if not self.emulated:
            return real.then(lambda fut: fut.value()[0])
        out = torch.futures.Future()
        real.add_done_callback(lambda fut: self._timer.at(end, out, t))
        return out

    def reset(self) -> None:
        self.spans.clear()
        self.link_free = 0.0

