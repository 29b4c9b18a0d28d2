"""The emulated cluster's communication: the comm ledger's observer, timing each ``torch.distributed`` call on this
rank's links (``Emulator`` is a ``CommHooks``; ``toolkit.runtime.emulator`` draws the whole)::

    dist.all_gather(...)  ─ the ledger, after the real op ─► on_collective: end_r on this rank's link (vclock.issue),
                                                             a side all_reduce(MAX) of [end_r, start_r] on the group
    dist.isend / irecv    ─────────────────────────────────► on_send / on_recv: the sender's end travels beside the
                                                             payload (same tag); the receiver completes at it
    work.wait()           ─ EmulatedWork ──────────────────► the waiting thread's stream moves to the completion

Inside ``Emulator.paused()`` (on any thread) every call passes through as without an emulated cluster.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .ledger import quiet
from .opcost import _tensors, element_bytes


class CommHooks:
    """What the comm ledger calls (``CommLedger.observer``) for every counted call: needs the emulator's clock,
    rank, world size, ``byte_scale``, lock, ``_tid`` and ``internal``; ``_pauses`` counts the threads inside
    ``paused()``: while it is not 0, every call passes through untimed."""

    @contextlib.contextmanager
    def _side(self):
        """The clock's own messages: neither timed, nor counted by the ledger, nor emulated."""
        with self.internal(), quiet():
            yield

    def ranks_of(self, group) -> list[int]:
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = (list(range(self.world_size)) if group is None or group is dist.group.WORLD
                                      else dist.get_process_group_ranks(group))
        return self._group_ranks[key]

    def _collective_key(self, group) -> tuple:
        """What the ranks of ``group`` call its next collective alike: the group's name and how many it had."""
        g = group if group is not None else dist.group.WORLD
        name = getattr(g, "group_name", None) or str(self.ranks_of(group))
        self._sequence[("c", name)] += 1
        return ("c", name, self._sequence[("c", name)])

    def _p2p_key(self, src: int, dst: int, tag: int) -> tuple:
        self._sequence[("p", src, dst, tag)] += 1
        return ("p", src, dst, tag, self._sequence[("p", src, dst, tag)])

    def _virtual_bytes(self, sent: int, tensor: torch.Tensor | None) -> float:
        """Sent bytes at the target's element size (float payloads at ``float_bytes``)."""
        if tensor is None or not sent:
            return float(sent) * self.byte_scale
        return sent * self.byte_scale * element_bytes(tensor.dtype, self.cluster.float_bytes) / tensor.element_size()

    def _issue(self, op: str, peers: list[int], wire: float, tag: str, key: tuple) -> dict:
        with self._lock:
            return self.clock.issue(self._tid(), op, [self.rank] + peers, wire, tag, key)

    def _finish(self, rec: dict, msg: "_ClockMessage") -> None:
        """The transfer of ``rec`` is waited for: this thread's stream waits for its virtual completion (a
        barrier also blocks the host)."""
        with self._side():
            start, done = msg.interval()
        with self._lock:
            self.clock.finish(self._tid(), rec, start, done, barrier=rec["op"] == "barrier")

    def _returned(self, work, rec: dict, msg: "_ClockMessage", is_async: bool):
        if not is_async:
            self._finish(rec, msg)
            return work
        return EmulatedWork(self, work, rec, msg)

    def on_collective(self, op: str, group, sent: int, args, kwargs, work, is_async: bool, tag: str):
        """A collective was issued (``work``: its handle if async): its end on this rank's link, then a side
        all_reduce(MAX) of the ends on the same group gives its completion. Returns what the caller gets."""
        if self._pauses:
            return work
        tensors = _tensors((args, kwargs))
        key = self._collective_key(group)
        rec = self._issue(op, [r for r in self.ranks_of(group) if r != self.rank],
                          self._virtual_bytes(sent, tensors[0] if tensors else None), tag, key)
        with self._side():
            stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
            msg = _ClockMessage(dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True), stamp)
        return self._returned(work, rec, msg, is_async)

    @staticmethod
    def _p2p_args(args, kwargs, key: str, group) -> tuple[int | None, int]:
        """(peer's global rank, tag) of a send/recv call."""
        peer = kwargs.get(key, args[1] if len(args) > 1 else None)
        if peer is None and kwargs.get("group_" + key) is not None:
            peer = dist.get_global_rank(group, kwargs["group_" + key])
        return peer, kwargs.get("tag", args[3] if len(args) > 3 else 0)

    def on_send(self, op: str, group, sent: int, args, kwargs, work, is_async: bool, tag: str):
        """A send: its end on this rank's link travels to the receiver beside the payload (same tag)."""
        if self._pauses:
            return work
        dst, msg_tag = self._p2p_args(args, kwargs, "dst", group)
        rec = self._issue(op, [dst], self._virtual_bytes(sent, _tensors((args, kwargs))[0]), tag,
                          self._p2p_key(self.rank, dst, msg_tag))
        with self._side():
            stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
            msg = _ClockMessage(dist.isend(stamp, dst, group=group, tag=msg_tag), stamp)
        return self._returned(work, rec, msg, is_async)

    def on_recv(self, op: str, group, args, kwargs, work, is_async: bool, tag: str):
        """A receive: completes at the sender's end (the side message after the payload)."""
        if self._pauses:
            return work
        src, msg_tag = self._p2p_args(args, kwargs, "src", group)
        if src is None:
            if is_async:
                raise ValueError("an irecv from any source (src=None) cannot be emulated: the arrival time comes "
                                 "from the sender; name src")
            src = work  # a blocking recv returns the sender's rank
        with self._lock:
            rec = self.clock.receive(self._tid(), op, tag, self._p2p_key(src, self.rank, msg_tag))
        with self._side():
            stamp = torch.zeros(2, dtype=torch.float64)
            msg = _ClockMessage(dist.irecv(stamp, src, group=group, tag=msg_tag), stamp)
        return self._returned(work, rec, msg, is_async)

    def on_batch(self, p2p_ops: list, works: list, tag: str) -> list:
        """``batch_isend_irecv``: each op's clock message goes out after all payloads, in the same order."""
        if self._pauses:
            return works
        side_ops, pending = [], []
        for p in p2p_ops:
            sending = getattr(p.op, "__name__", "") == "isend"
            peer = p.peer  # a global rank
            with self._side():
                if sending:
                    rec = self._issue("isend", [peer], self._virtual_bytes(
                        p.tensor.numel() * p.tensor.element_size(), p.tensor), tag, self._p2p_key(self.rank, peer,
                                                                                                  p.tag))
                    stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
                else:
                    with self._lock:
                        rec = self.clock.receive(self._tid(), "irecv", tag, self._p2p_key(peer, self.rank, p.tag))
                    stamp = torch.zeros(2, dtype=torch.float64)
            side_ops.append(dist.P2POp(p.op, stamp, p.peer, p.group, p.tag))
            pending.append((rec, stamp))
        with self._side():
            side_works = dist.batch_isend_irecv(side_ops)
        return [EmulatedWork(self, work, rec, _ClockMessage(side, stamp))
                for work, side, (rec, stamp) in zip(works, side_works, pending)]

    # ---- DDP: its C++ reducer is seen only through a comm hook --------------------------------------------------
    def ddp_hook(self, state, bucket):  # no annotations: DDP checks them against Future[Tensor] objects
        """A DDP comm hook (``ddp.register_comm_hook(group_or_None, emulator.ddp_hook)``): the bucket's average by
        ``dist.all_reduce`` (seen by the ledger and this clock), waited on the main clock when backward ends."""
        t = bucket.buffer()
        group = state
        t.div_(dist.get_world_size(group))
        work = dist.all_reduce(t, group=group, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(work.wait)
        return work.get_future().then(lambda fut: fut.value()[0])


class _ClockMessage:
    """The side message that carries a transfer's virtual [end, start]: one this rank sent (known here), or one
    received, or reduced (MAX over the group) into ``stamp``."""

    def __init__(self, work, stamp: torch.Tensor):
        self.work, self.stamp = work, stamp

    def ready(self) -> bool:
        return self.work.is_completed()

    def interval(self) -> tuple[float, float]:
        """(start, end) of the transfer on the wire (a collective's: its latest start and latest end)."""
        self.work.wait()
        end, start = self.stamp.tolist()
        return start, end

    def value(self) -> float:
        return self.interval()[1]


class EmulatedWork:
    """An async op's handle: ``wait()`` waits for the real op, then moves the waiting thread's clock to the op's
    virtual completion. ``is_completed()`` answers in virtual time (and only True once the real op is done too),
    so polling never moves a clock: a wait after it finds the completion already passed."""

    def __init__(self, emulator: CommHooks, work, rec: dict, msg: _ClockMessage):
        self._emu, self._work, self._rec, self._msg = emulator, work, rec, msg

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs) if self._work is not None else True
        self._emu._finish(self._rec, self._msg)
        return out

    def is_completed(self) -> bool:
        if not (self._work.is_completed() and self._msg.ready()):
            return False
        with self._emu._side():
            return self._msg.value() <= self._emu.now()

    @property
    def exposed(self) -> tuple[float, float]:
        """(seconds this op's waits moved the clock, the part of them with its bytes on the wire)."""
        return self._rec["exposed"] or 0.0, self._rec.get("exposed_wire", 0.0)

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)
