"""Communication ledger: every collective and point-to-point call, its bytes and its time.

While a :class:`CommLedger` is installed (the lesson worker installs one per rank),
the functions of ``torch.distributed`` that lessons use are wrapped, so the toolkit's
own code, FSDP2 and user code are all counted without changing a line of them.

Bytes are counted from tensor sizes, never timed or guessed, as *bytes this rank puts
on the wire* under the textbook algorithm for each op (n = group size, S = the
op's full buffer in bytes, the same convention as nccl-tests' bus bandwidth)::

    all_reduce               2(n-1)/n * S      (ring: reduce-scatter + all-gather)
    all_gather_into_tensor    (n-1)/n * S_out
    reduce_scatter_tensor     (n-1)/n * S_in
    all_to_all_single        bytes of the input splits addressed to other ranks
    broadcast                 S on every rank  (pipelined ring/tree; upper bound)
    reduce                    (n-1)/n * S      (ring reduce-scatter, then the pieces to the root)
    send / isend              S                (recv / irecv count as received)

Times are wall-clock from call to completion; for ``async_op=True`` the returned
work handle is wrapped so the time runs until its ``wait()``.

An ``observer`` (the emulated cluster's clock, ``shapes``' estimate) sees every counted call after it was
issued and returns what the caller gets; the ledger knows nothing else of it. Calls issued inside a tracked
call, or inside ``quiet()``, are neither counted nor observed: that is per thread, not per ledger (one ledger
wraps ``torch.distributed`` at a time).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

_TRACKED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
            "broadcast", "all_gather", "reduce_scatter", "send", "recv", "isend", "irecv",
            "batch_isend_irecv", "barrier", "all_gather_single", "reduce_scatter_single", "reduce")
# torch >= 2.13 spells the flat collectives *_single (FSDP2 and toolkit.runtime.compat call those); they are
# recorded under the old names, which every supported torch has
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
_THREAD = threading.local()  # .depth: tracked calls this thread is inside


def inside_op() -> bool:
    """This thread is inside a tracked call (its own ATen work, e.g. gloo's copies, is part of the call)."""
    return getattr(_THREAD, "depth", 0) > 0


@contextlib.contextmanager
def quiet():
    """Calls issued inside on this thread are neither counted nor observed (the emulator's side messages; the calls
    a tracked call issues itself, e.g. batch_isend_irecv's isends)."""
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1


@dataclass
class CommRecord:
    op: str
    group: str
    group_size: int
    payload_bytes: int  # size of the op's buffer on this rank
    sent_bytes: int  # bytes this rank puts on the wire (see module docstring)
    recv_bytes: int
    seconds: float
    tag: str
    is_async: bool


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def wire_bytes(op: str, n: int, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """(payload, sent, received) bytes on one rank for a call of ``op`` in a group of ``n``."""
    a = list(args)
    get = lambda i, k: kwargs[k] if k in kwargs else (a[i] if len(a) > i else None)
    if op == "all_reduce":
        s = _nbytes(get(0, "tensor"))
        w = 2 * (n - 1) * s // n
        return s, w, w
    if op == "all_gather_into_tensor":
        s = _nbytes(get(0, "output_tensor"))
        return s, (n - 1) * s // n, (n - 1) * s // n
    if op == "all_gather":
        s = _nbytes(get(1, "tensor")) * n
        return s, (n - 1) * s // n, (n - 1) * s // n
    if op in ("reduce_scatter_tensor", "reduce_scatter"):
        s = _nbytes(get(1, "input")) if op == "reduce_scatter_tensor" else _nbytes(get(1, "input_list"))
        return s, (n - 1) * s // n, (n - 1) * s // n
    if op == "all_to_all_single":
        out, inp = get(0, "output"), get(1, "input")
        out_splits, in_splits = get(2, "output_split_sizes"), get(3, "input_split_sizes")
        s = _nbytes(inp)
        row_in = s // max(inp.shape[0], 1) if inp.dim() else s
        row_out = _nbytes(out) // max(out.shape[0], 1) if out.dim() else _nbytes(out)
        me = dist.get_rank(get(4, "group")) if n > 1 else 0
        if in_splits:
            sent = sum(c for i, c in enumerate(in_splits) if i != me) * row_in
        else:
            sent = (n - 1) * s // n
        if out_splits:
            recv = sum(c for i, c in enumerate(out_splits) if i != me) * row_out
        else:
            recv = (n - 1) * _nbytes(out) // n
        return s, sent, recv
    if op == "broadcast":
        s = _nbytes(get(0, "tensor"))
        return s, s, s
    if op == "reduce":
        s = _nbytes(get(0, "tensor"))
        return s, (n - 1) * s // n, (n - 1) * s // n
    if op in ("send", "isend"):
        s = _nbytes(get(0, "tensor"))
        return s, s, 0
    if op in ("recv", "irecv"):
        s = _nbytes(get(0, "tensor"))
        return s, 0, s
    return 0, 0, 0


class _TimedWork:
    """Wraps an async work handle so that ``wait()`` closes the ledger record."""

    def __init__(self, work, record: CommRecord, start: float):
        self._work, self._record, self._start = work, record, start

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._record.seconds == 0.0:
            self._record.seconds = time.perf_counter() - self._start
        return out

    def get_future(self):
        """The op's future, chained so that its completion closes the record (DDP comm hooks use this)."""
        def close(fut):
            if self._record.seconds == 0.0:
                self._record.seconds = time.perf_counter() - self._start
            return fut.value()
        return self._work.get_future().then(close)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommLedger:
    """Counts calls, bytes and time of ``torch.distributed`` ops on this rank.

    Usage (inside a rank)::

        ledger = CommLedger(group_names={id(tp_group): "tp"}).install()
        with ledger.tag("baseline"):
            step()
        ledger.summary()            # [{'tag','op','group','calls','sent_bytes',...}, ...]
    """

    def __init__(self, group_names: dict[int, str] | None = None):
        self.records: list[CommRecord] = []
        self.group_names: dict[int, str] = dict(group_names or {})
        self._tag = "untagged"
        self._originals: dict[str, object] = {}
        self.observer = None  # its on_collective / on_send / on_recv / on_batch return what the caller gets

    # ---- installation -------------------------------------------------------------
    def install(self) -> "CommLedger":
        """Wrap the tracked functions in ``torch.distributed`` and in ``distributed_c10d`` (where
        ``P2POp`` checks its op and where internal callers look them up)."""
        for name in _TRACKED:
            if name in self._originals or not hasattr(dist, name):
                continue
            original = getattr(dist, name)
            self._originals[name] = original
            wrapped = self._wrap(ALIASES.get(name, name), original)
            for namespace in (dist, _c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapped)
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            for namespace in (dist, _c10d):
                if hasattr(namespace, name):
                    setattr(namespace, name, fn)
        self._originals.clear()

    def name_group(self, group, name: str) -> None:
        """Label a process group so summaries say ``tp`` instead of ``4 ranks``."""
        self.group_names[id(group)] = name

    # ---- recording ----------------------------------------------------------------
    @contextlib.contextmanager
    def tag(self, name: str):
        """Attribute every op issued inside the block to ``name`` (e.g. ``"zero3"``)."""
        previous, self._tag = self._tag, name
        try:
            yield self
        finally:
            self._tag = previous

    def reset(self) -> None:
        self.records.clear()

    def _group_of(self, name: str, args: tuple, kwargs: dict):
        if "group" in kwargs:
            return kwargs["group"]
        pos = {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "all_to_all_single": 4,
               "broadcast": 2, "reduce": 2, "all_gather": 2, "reduce_scatter": 3, "send": 2, "recv": 2, "isend": 2, "irecv": 2,
               "barrier": 0}.get(name)
        return args[pos] if pos is not None and len(args) > pos else None

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if inside_op():
                return original(*args, **kwargs)
            if name == "batch_isend_irecv":
                return self._batch(original, *args, **kwargs)
            group = self._group_of(name, args, kwargs)
            n = dist.get_world_size(group) if dist.is_initialized() else 1
            payload, sent, recv = wire_bytes(name, n, args, kwargs)
            label = self.group_names.get(id(group if group is not None else dist.group.WORLD),
                                         "world" if group is None else f"{n} ranks")
            is_async = bool(kwargs.get("async_op")) or name in ("isend", "irecv")
            rec = CommRecord(name, label, n, payload, sent, recv, 0.0, self._tag, is_async)
            start = time.perf_counter()
            with quiet():
                out = original(*args, **kwargs)
            self.records.append(rec)
            if is_async and out is not None:
                out = _TimedWork(out, rec, start)
            else:
                rec.seconds = time.perf_counter() - start
            return self._observed(name, group, sent, args, kwargs, out, is_async) if self.observer else out
        return wrapper

    def _observed(self, name, group, sent, args, kwargs, out, is_async):
        seen = self.observer
        if name in ("send", "isend"):
            return seen.on_send(name, group, sent, args, kwargs, out, is_async, self._tag)
        if name in ("recv", "irecv"):
            return seen.on_recv(name, group, args, kwargs, out, is_async, self._tag)
        return seen.on_collective(name, group, sent, args, kwargs, out, is_async, self._tag)

    def _batch(self, original, p2p_ops, *args, **kwargs):
        start = time.perf_counter()
        recs = []
        for p in p2p_ops:
            op_name = "isend" if getattr(p.op, "__name__", "") == "isend" else "irecv"
            n = dist.get_world_size(p.group) if p.group is not None else dist.get_world_size()
            payload, sent, recv = wire_bytes(op_name, n, (p.tensor,), {})
            recs.append(CommRecord(op_name, self.group_names.get(id(p.group), "p2p"), n, payload, sent, recv,
                                   0.0, self._tag, True))
        with quiet():
            works = original(p2p_ops, *args, **kwargs)
        self.records.extend(recs)
        works = [_TimedWork(w, r, start) for w, r in zip(works, recs)]
        return self.observer.on_batch(p2p_ops, works, self._tag) if self.observer else works

    # ---- reporting ----------------------------------------------------------------
    def summary(self, by: tuple[str, ...] = ("tag", "op", "group")) -> list[dict]:
        """One row per distinct ``by`` key: calls, payload/sent/received bytes, seconds."""
        rows: dict[tuple, dict] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0,
                                                       "recv_bytes": 0, "seconds": 0.0})
        for r in self.records:
            d = asdict(r)
            row = rows[tuple(d[k] for k in by)]
            row["calls"] += 1
            for k in ("payload_bytes", "sent_bytes", "recv_bytes", "seconds"):
                row[k] += d[k]
        return [{**dict(zip(by, key)), **val} for key, val in rows.items()]

    def total(self, field: str = "sent_bytes", tag: str | None = None, op: str | None = None) -> int:
        """Sum of one field over the records, optionally only one tag and/or op."""
        return sum(getattr(r, field) for r in self.records
                   if (tag is None or r.tag == tag) and (op is None or r.op == op))

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.records]
