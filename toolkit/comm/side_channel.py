"""A side channel for per-step values (top-k predictions, metrics) collected on one rank without stalling
training: a process group of its own and non-blocking point-to-point ops, waited on later.

::

    blocking (in the step)                               side channel
    ──────────────────────                               ────────────
    rank 0  F ─ all_gather ░░░░░ ─ B ─ F ─ ...            rank 0  F ─ post ─ B ─ F ─ post ─ ...  collect() once per step
    rank 1  F ──── F is longer ── all_gather ─ B ─ ...    rank 1  F ───── post ─ B ─ F ─ ...     (or whenever it suits)
            ░ = waiting for the slowest rank, every micro-batch        the bytes move on the group's own thread

``post(t)`` copies ``t`` into a host buffer the channel owns (so the caller may overwrite ``t``), then sends
it to ``dst`` (``isend``) or, on ``dst``, posts one ``irecv`` per peer; it returns at once (a GPU tensor is
copied on a side stream and sent by a helper thread when the copy's event has completed). ``collect()`` waits
for what was posted (``leave=m``: all but the newest m, e.g. the previous step's values) and returns, on
``dst``, ``{label: [value of rank 0, rank 1, ...]}``.

The group is ``new_group(backend="gloo")`` over CPU tensors, whatever the training backend: on a GPU job
its traffic then never enters the NCCL stream the gradients use. gloo runs ``isend``/``irecv``
on its own threads, so the transfer overlaps the training thread's work.

The source article uses UCX-Py for this. torch.distributed gives the same shape of solution without a new
dependency: a dedicated gloo group, ``isend``/``irecv``/``batch_isend_irecv`` (or ``gather`` with
``async_op=True``), work handles waited later; its ``ucc`` backend (where torch is built with it) runs on
UCX, and ``torch.distributed.rpc`` (TensorPipe) sends tensors point to point. UCX itself would matter for
RDMA (InfiniBand/RoCE) transfers that skip the kernel's TCP stack, GPU-direct sends between nodes, or
message rates where TCP's tens of microseconds per message dominate; for a few kilobytes per step over
loopback or Ethernet, gloo's TCP is not the bottleneck, the blocking placement is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class SideChannel:
    """Collect one tensor per rank and step label on ``dst``, asynchronously (see the module docstring).

    Every rank must call ``post`` with tensors of the same shape and dtype in the same order, and build the
    channel at the same point (``new_group`` is collective).
    """

    def __init__(self, dst: int = 0, group=None):
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.group = dist.new_group(ranks, backend="gloo")
        self.dst, self.rank, self.ranks = dst, dist.get_rank(), ranks
        self.cuda_stream = None
        self._pool = None
        self.pending: list[tuple[object, list, list[torch.Tensor]]] = []  # (label, work handles, buffers)
        self.bytes_posted = 0

    def post(self, t: torch.Tensor, label: object = None) -> None:
        """Send ``t`` (any device) to ``dst`` without waiting; on ``dst`` post the receives."""
        buf, ready = self._host_copy(t)
        if self.rank == self.dst:
            bufs = [buf if r == self.dst else torch.empty(buf.shape, dtype=buf.dtype) for r in self.ranks]
            works = [dist.irecv(b, src=r, group=self.group) for r, b in zip(self.ranks, bufs) if r != self.dst]
            if ready is not None:
                works.append(_EventWork(ready))
        else:
            bufs = [buf]
            self.bytes_posted += buf.numel() * buf.element_size()
            if ready is None:
                works = [dist.isend(buf, dst=self.dst, group=self.group)]
            else:  # send from a helper thread once the device-to-host copy has landed: the step never waits
                works = [_Deferred(self._sender().submit(self._send_when_ready, ready, buf))]
        self.pending.append((label, works, bufs))

    def _sender(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side-channel")
        return self._pool

    def _send_when_ready(self, ready, buf: torch.Tensor):
        ready.synchronize()
        return dist.isend(buf, dst=self.dst, group=self.group)

    def _host_copy(self, t: torch.Tensor):
        """A copy of ``t`` in host memory the channel owns, and (CUDA) the event that marks it complete."""
        if t.device.type != "cuda":
            return t.detach().clone(), None
        if self.cuda_stream is None:
            self.cuda_stream = torch.cuda.Stream(t.device)
        self.cuda_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.cuda_stream):
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t.detach(), non_blocking=True)
            t.record_stream(self.cuda_stream)
            ready = torch.cuda.Event()
            ready.record()
        return buf, ready

    def collect(self, leave: int = 0) -> dict:
        """Wait for everything posted except the newest ``leave`` posts; on ``dst`` return
        ``{label: [tensor of each rank]}`` for those, elsewhere ``{}``.

        ``collect(leave=m)`` at the end of a step of ``m`` posts takes the previous step's values: by then
        they have long arrived, and no rank waits for a peer that is still finishing this step.
        """
        done, self.pending = self.pending[:len(self.pending) - leave], self.pending[len(self.pending) - leave:]
        out = {}
        for label, works, bufs in done:
            for w in works:
                w.wait()
            if self.rank == self.dst:
                out[label] = bufs
        return out

    def close(self) -> None:
        self.collect()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _EventWork:
    def __init__(self, event):
        self.event = event

    def wait(self):
        self.event.synchronize()


class _Deferred:
    """The work handle of an isend that a helper thread issues later."""

    def __init__(self, future):
        self.future = future

    def wait(self):
        self.future.result().wait()


def blocking_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """The baseline: every rank ``all_gather``\\ s ``t`` inside the step and waits for the slowest one."""
    n = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return out
