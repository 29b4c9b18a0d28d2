"""One rank's virtual clock, its trace, and the replay that re-times a recorded run under other cluster figures.

The emulated cluster (``toolkit.runtime.emulator``) drives a ``RankClock`` live: every kernel, transfer, wait and
mark of the real program is one call, and each call appends one event to the rank's trace. ``replay`` feeds the
same events, from every rank at once, to fresh clocks on another cluster — the same code on other numbers — and
matches what ranks exchanged live through side messages (a collective's completion, a send's arrival) from the
other ranks' traces. ASTRA-sim and Chakra re-time a workload from traces this way::

    live (a launch)                                   replay (milliseconds, any process)
    rank r: op ─► RankClock.compute ─► trace_r        traces_0..n-1 ─► RankClock x n on cluster'
            collective ─► issue ─► side all_reduce     issue events publish each rank's end; a finish waits
                       ─► finish (the group's max)     until every rank of the group has published
            mark("step")                               marks, comms, ops: the same views, other times

At unchanged figures a replay gives back the recorded times exactly (``tests/test_emulator.py``). It equals a
fresh run at other figures as long as the program's ops do not depend on the clock (none of the toolkit's do:
``EmulatedWork.is_completed`` is the one place a program could branch on virtual time).

Per rank, per thread: a host that issues and a stream that runs (now = max(host, stream)); each link class a
queue per thread (a side thread's transfers queue on their own); host copies and disk I/O queues of their own.
A communication kernel takes ``Link.channels`` SMs of the GPU while it runs: a kernel that overlaps it runs
at (SMs − channels) / SMs of its speed (NCCL: one SM per channel; DeepSeek-V3 reserved 20 of 132 for its own).
"""
from __future__ import annotations

import math
from collections import defaultdict

from .collectives import transfer
from .efficiency import Kernel, kernel_seconds

# event codes (the first item of each trace event)
COMPUTE, SYNC, ISSUE, FINISH, RECV, LOCAL, LOCAL_WAIT, LOCAL_WAIT_HOST, GRAPH_BEGIN, GRAPH_END, FORK, JOIN, MARK, \
    THREAD, RESET = range(15)


class Stamp(float):
    """A virtual time that another thread (or a later call) will wait for, with where it came from, so that a
    replay can put the replayed time in its place: ``("fork", i)`` or ``("end", comm record)``."""

    ref: tuple | None

    def __new__(cls, value: float, ref: tuple | None):
        s = super().__new__(cls, value)
        s.ref = ref
        return s


class _Clock:
    __slots__ = ("host", "stream")

    def __init__(self, host: float, stream: float):
        self.host, self.stream = host, stream

    @property
    def now(self) -> float:
        return max(self.host, self.stream)


def _row() -> dict:
    return {"calls": 0, "flops": 0.0, "bytes": 0.0, "model_s": 0.0, "launch_s": 0.0, "cpu_s": 0.0}


class RankClock:
    """The virtual time of one rank on ``cluster``: its threads' clocks, its link queues, what its transfers and
    kernels cost, and the trace of it all (``record``). See the module docstring."""

    def __init__(self, cluster, rank: int, world_size: int, record: bool = True):
        self.cluster, self.rank, self.world_size = cluster, rank, world_size
        self.trace: list[tuple] | None = [] if record else None
        self.kernels: list[tuple[str, Kernel]] = []  # interned (name, kernel): events refer to them by index
        self.ranks: list[tuple[int, ...]] = []  # interned groups of a transfer
        self._kernel_ids: dict = {}
        self._rank_ids: dict = {}
        self._costs: dict = {}
        self.reset(record_event=False)

    # ---- state ------------------------------------------------------------------------------------------------
    def reset(self, record_event: bool = True) -> None:
        """Every clock, queue and record back to 0 (the rank calls it right after the ranks' start barrier)."""
        self.threads: dict[int, _Clock] = {0: _Clock(0.0, 0.0)}
        self.link_free: dict[str, float] = defaultdict(float)
        self.comms: list[dict] = []
        self.ops: dict[str, dict] = defaultdict(_row)
        self.marks: list[tuple[int, str, float]] = []
        self.stamps: list[float] = []
        self.active: list[tuple[float, float, float]] = []  # (start, end, SM share) of this rank's comm kernels
        self.graph_depth = 0
        if record_event:
            self._log((RESET,))

    def _log(self, event: tuple) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def now(self, tid: int = 0) -> float:
        return self.threads[tid].now

    def thread(self, tid: int, start: Stamp | float | None = None) -> None:
        """A new thread's clock: at ``start`` (a stamp handed over) or where the main thread is now."""
        t = self.threads[0].now if start is None else self._resolve(start)
        self.threads[tid] = _Clock(t, t)
        self._log((THREAD, tid, _ref(start)))

    def _resolve(self, stamp) -> float:
        return float(stamp)

    # ---- compute ----------------------------------------------------------------------------------------------
    def kernel_id(self, name: str, kernel: Kernel) -> int:
        key = (name, kernel)
        kid = self._kernel_ids.get(key)
        if kid is None:
            kid = self._kernel_ids[key] = len(self.kernels)
            self.kernels.append(key)
        return kid

    def _cost(self, kid: int, flop_scale: float, byte_scale: float, on_host: bool) -> float:
        key = (kid, flop_scale, byte_scale, on_host)
        secs = self._costs.get(key)
        if secs is None:
            k = self.kernels[kid][1]
            if on_host:  # the host CPU: a roofline of its peaks (``Cluster.cpu``), no launches
                cpu = self.cluster.cpu
                secs = max(k.flops * flop_scale / cpu.bf16_flops, k.bytes * byte_scale / cpu.hbm_bytes_per_s)
            else:
                g = self.cluster.gpu
                secs = kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency, flop_scale, byte_scale)
            self._costs[key] = secs
        return secs

    def compute(self, tid: int, kid: int, flop_scale: float = 1.0, byte_scale: float = 1.0, on_host: bool = False,
                cpu_s: float = 0.0) -> float:
        """One kernel (``kernel_id``): eager, the host pays one op; the stream runs it once both that and the
        kernels before it are done, slowed where a comm kernel of this rank holds SMs. Returns its seconds."""
        self._log((COMPUTE, tid, kid, flop_scale, byte_scale, on_host))
        name, k = self.kernels[kid]
        secs = self._cost(kid, flop_scale, byte_scale, on_host)
        clock = self.threads[tid]
        launch = 0.0
        if on_host:
            clock.host += secs
            name = "host: " + name
        else:
            launch = 0.0 if self.graph_depth else self.cluster.gpu.efficiency.host_op_s * k.count
            clock.host += launch
            start = max(clock.host, clock.stream)
            clock.stream = self._contended(start, secs)
            secs = clock.stream - start
        row = self.ops[name]
        row["calls"] += 1
        row["flops"] += k.flops  # the program's own (``scaled`` times them as more)
        row["bytes"] += k.bytes
        row["model_s"] += secs
        row["launch_s"] += launch
        row["cpu_s"] += cpu_s
        return secs

    def _contended(self, start: float, work: float) -> float:
        """When a kernel of ``work`` seconds alone, started at ``start``, ends while comm kernels hold SMs."""
        if not self.active:
            return start + work
        self.active = [a for a in self.active if a[1] > start]
        t, left = start, work
        edges = sorted({e for a in self.active for e in a[:2] if e > start})
        for edge in edges:
            share = min(0.9, sum(s for a0, a1, s in self.active if a0 <= t < a1))
            rate = 1.0 - share
            if left <= (edge - t) * rate:
                return t + left / rate
            left -= (edge - t) * rate
            t = edge
        return t + left

    def sync(self, tid: int) -> None:
        """The host waits for its stream (``torch.cuda.synchronize``, ``.item()``, a barrier)."""
        self._log((SYNC, tid))
        clock = self.threads[tid]
        clock.host = clock.stream = clock.now

    def wait_until(self, tid: int, t: float) -> float:
        clock = self.threads[tid]
        before = clock.now
        clock.stream = max(clock.stream, t)
        return clock.now - before

    def graph(self, tid: int, begin: bool) -> None:
        """A CUDA graph replay starts (the host pays one launch for all its kernels) or ends."""
        self._log((GRAPH_BEGIN if begin else GRAPH_END, tid))
        if begin:
            self.graph_depth += 1
            if self.graph_depth == 1:
                launch = self.cluster.gpu.launch_s
                self.threads[tid].host += launch
                row = self.ops["cuda graph replay"]
                row["calls"] += 1
                row["launch_s"] += launch
        else:
            self.graph_depth -= 1

    # ---- transfers ------------------------------------------------------------------------------------------
    def _ranks_id(self, ranks) -> int:
        key = tuple(ranks)
        rid = self._rank_ids.get(key)
        if rid is None:
            rid = self._rank_ids[key] = len(self.ranks)
            self.ranks.append(key)
        return rid

    def issue(self, tid: int, op: str, ranks, wire_bytes: float, tag: str, key: tuple | None) -> dict:
        """A collective or a send of ``wire_bytes`` (the bytes this rank puts on its link, nccl-tests' bus
        convention) among ``ranks`` (global, this rank first): it queues on this thread's queue of the link the
        group spans and holds its channels' SMs while on the wire. ``key`` names what the other ranks receive
        of it (a collective's side all_reduce, a send's side message). Returns its record."""
        rid = self._ranks_id(ranks)
        self._log((ISSUE, tid, op, rid, wire_bytes, tag, key))
        seconds, link = transfer(self.cluster, op, self.ranks[rid], self.world_size, wire_bytes)
        queue = link.name if tid == 0 else f"{link.name} [thread {tid}]"
        issue = self.threads[tid].now
        start = max(issue, self.link_free[queue])
        end = self.link_free[queue] = start + seconds
        share = link.channels / self.cluster.gpu.sms
        if share > 0 and end > start:
            self.active.append((start, end, share))
            for clock in self.threads.values():  # kernels already queued past the start lose the SMs too
                if clock.stream > start:
                    clock.stream += (min(clock.stream, end) - start) * share / (1 - share)
        return self._record({"op": op, "tag": tag, "link": link.name, "bytes": wire_bytes, "issue": issue,
                             "start": start, "local_end": end, "done": None, "exposed": None, "key": key})

    def _record(self, rec: dict) -> dict:
        rec["index"] = len(self.comms)
        self.comms.append(rec)
        return rec

    def receive(self, tid: int, op: str, tag: str, key: tuple | None) -> dict:
        """The record of a transfer this rank only receives (its time is the sender's)."""
        self._log((RECV, tid, op, tag, key))
        return self._record({"op": op, "tag": tag, "link": None, "bytes": 0.0, "issue": self.threads[tid].now,
                             "start": None, "local_end": None, "done": None, "exposed": None, "key": key})

    def finish(self, tid: int, rec: dict, start: float, done: float, barrier: bool = False) -> float:
        """This thread's stream waits for a transfer's completion ``done`` (its bytes on the wire from ``start``);
        a barrier also blocks the host. Returns the time the clock moved."""
        self._log((FINISH, tid, rec["index"], barrier))
        rec["done"] = done
        before = self.threads[tid].now
        waited = self.wait_until(tid, done)
        wire = max(0.0, done - max(start, before)) if waited > 0 else 0.0  # the rest: waiting for a late peer
        rec["exposed"] = (rec["exposed"] or 0.0) + waited
        rec["exposed_wire"] = rec.get("exposed_wire", 0.0) + wire
        if barrier:
            clock = self.threads[tid]
            clock.host = clock.stream = clock.now
        return waited

    # ---- the host and the disk ------------------------------------------------------------------------------
    def local(self, tid: int, queue: str, nbytes: float, tag: str, op: str, write: bool = False,
              after: Stamp | float = 0.0) -> dict:
        """A copy between device and host (``queue`` "d2h" or "h2d", a copy engine each) or disk I/O ("disk"):
        it starts when this thread's work so far is issued, its queue is free and ``after`` (an earlier copy's
        end) has passed; compute goes on meanwhile."""
        self._log((LOCAL, tid, queue, nbytes, tag, op, write, _ref(after)))
        c = self.cluster
        seconds = c.disk.seconds(nbytes, write) if queue == "disk" else c.host.seconds(nbytes)
        issue = self.threads[tid].now
        start = max(issue, self.link_free[queue], self._resolve(after))
        end = self.link_free[queue] = start + seconds
        return self._record({"op": op, "tag": tag, "link": queue, "bytes": nbytes, "issue": issue, "start": start,
                             "local_end": end, "done": None, "exposed": None, "key": None})

    def end_stamp(self, rec: dict) -> Stamp:
        return Stamp(rec["local_end"], ("end", rec["index"]))

    def local_wait(self, tid: int, rec: dict, host: bool = False) -> float:
        """The stream (``host``: the host) waits for a local copy; returns the time the clock moved."""
        self._log((LOCAL_WAIT_HOST if host else LOCAL_WAIT, tid, rec["index"]))
        rec["done"] = rec["local_end"]
        clock = self.threads[tid]
        if host:
            before = clock.host
            clock.host = max(clock.host, rec["local_end"])
            return clock.host - before
        before = clock.now
        waited = self.wait_until(tid, rec["local_end"])
        rec["exposed"] = (rec["exposed"] or 0.0) + waited
        rec["exposed_wire"] = rec.get("exposed_wire", 0.0) + (
            max(0.0, rec["local_end"] - max(rec["start"], before)) if waited > 0 else 0.0)
        return waited

    # ---- threads and marks ----------------------------------------------------------------------------------
    def fork(self, tid: int) -> Stamp:
        """A stamp of this thread's time, for a thread that takes over work from it (``join``)."""
        self._log((FORK, tid))
        self.stamps.append(self.threads[tid].now)
        return Stamp(self.stamps[-1], ("fork", len(self.stamps) - 1))

    def join(self, tid: int, stamp: Stamp | float) -> None:
        """This thread continues work handed over at ``stamp`` (its host and stream move there if behind)."""
        self._log((JOIN, tid, _ref(stamp)))
        t = self._resolve(stamp)
        clock = self.threads[tid]
        clock.host, clock.stream = max(clock.host, t), max(clock.stream, t)

    def mark(self, tid: int, name: str) -> float:
        """Record this thread's time under ``name`` (what a replay reads back: ``marks_named``)."""
        self._log((MARK, tid, name))
        t = self.threads[tid].now
        self.marks.append((tid, name, t))
        return t

    def marks_named(self, name: str) -> list[float]:
        return [t for _, n, t in self.marks if n == name]

    def window(self, name: str, ops=None) -> dict[str, float]:
        """The last block marked ``name`` (``Emulator.window``): ``s``, its virtual seconds, and ``exposed_s``, the
        time clocks waited for transfers and copies issued inside it (of the ``ops`` named, or all)."""
        start, end = self.marks_named(f"{name}:start"), self.marks_named(f"{name}:end")
        if not start or not end:
            raise KeyError(f"no window {name!r} on rank {self.rank}")
        t0, t1 = start[-1], end[-1]
        exposed = sum(c["exposed"] or 0.0 for c in self.comms
                      if t0 <= c["issue"] <= t1 and (ops is None or c["op"] in ops))
        return {"s": t1 - t0, "exposed_s": exposed}


def _ref(stamp) -> tuple | float | None:
    """How a trace names a time handed between threads: a stamp's origin, else the number itself."""
    if stamp is None or isinstance(stamp, tuple):  # a replay passes the trace's own reference on
        return stamp
    ref = getattr(stamp, "ref", None)
    return ref if ref is not None else float(stamp)


# ---- replay ------------------------------------------------------------------------------------------------------
class _Replayed(RankClock):
    """A clock fed from a trace: stamps resolve to the replayed times they stand for."""

    def _resolve(self, stamp) -> float:
        if isinstance(stamp, tuple):
            kind, index = stamp
            return self.stamps[index] if kind == "fork" else self.comms[index]["local_end"]
        return 0.0 if stamp is None else float(stamp)


def export(clock: RankClock) -> dict:
    """A rank's trace, plain and picklable (``replay`` reads a list of them, one per rank)."""
    return {"rank": clock.rank, "world_size": clock.world_size, "events": list(clock.trace or ()),
            "kernels": [(name, k.kind, k.flops, k.bytes, tuple(k.dims), k.count) for name, k in clock.kernels],
            "ranks": list(clock.ranks)}


def replay(traces: list[dict], cluster) -> list[RankClock]:
    """Every rank's trace (``export``) run again on ``cluster``: one clock per rank, in rank order, holding the
    replayed marks, comm records and op rows. Cross-rank values are matched by the keys the live run gave them
    (a collective: every rank of its group has issued it; a receive: its sender has)."""
    traces = sorted(traces, key=lambda t: t["rank"])
    world = traces[0]["world_size"]
    if [t["rank"] for t in traces] != list(range(world)):
        raise ValueError(f"replay needs one trace per rank 0..{world - 1}, got ranks {[t['rank'] for t in traces]}")
    clocks = []
    for t in traces:
        c = _Replayed(cluster, t["rank"], world, record=False)
        c.kernels = [(k[0], Kernel(k[1], k[2], k[3], tuple(k[4]), k[5])) for k in t["kernels"]]
        c.ranks = [tuple(r) for r in t["ranks"]]
        clocks.append(c)
    published: dict[tuple, list] = defaultdict(list)  # key -> (end, start) of each rank that issued it
    needed: dict[tuple, int] = {}
    at = [0] * world
    events = [t["events"] for t in traces]
    pending = set(range(world))
    while pending:
        moved = False
        for r in sorted(pending):
            c, evs, i = clocks[r], events[r], at[r]
            while i < len(evs):
                e = evs[i]
                code = e[0]
                if code == FINISH:
                    rec = c.comms[e[2]]
                    key = rec["key"]
                    got = published.get(key, ())
                    if len(got) < needed.get(key, math.inf):
                        break  # a peer has not issued it yet
                    start, done = max(g[1] for g in got), max(g[0] for g in got)
                    c.finish(e[1], rec, start, done, e[3])
                elif code == COMPUTE:
                    c.compute(e[1], e[2], e[3], e[4], e[5])
                elif code == ISSUE:
                    _, tid, op, rid, wire, tag, key = e
                    rec = c.issue(tid, op, c.ranks[rid], wire, tag, key)
                    if key is not None:
                        published[key].append((rec["local_end"], rec["start"]))
                        needed[key] = 1 if key[0] == "p" else len(c.ranks[rid])
                elif code == RECV:
                    c.receive(e[1], e[2], e[3], e[4])
                    if e[4] is not None:
                        needed.setdefault(e[4], 1)
                elif code == SYNC:
                    c.sync(e[1])
                elif code == LOCAL:
                    _, tid, queue, nbytes, tag, op, write, after = e
                    c.local(tid, queue, nbytes, tag, op, write, after if after is not None else 0.0)
                elif code in (LOCAL_WAIT, LOCAL_WAIT_HOST):
                    c.local_wait(e[1], c.comms[e[2]], host=code == LOCAL_WAIT_HOST)
                elif code in (GRAPH_BEGIN, GRAPH_END):
                    c.graph(e[1], code == GRAPH_BEGIN)
                elif code == FORK:
                    c.fork(e[1])
                elif code == JOIN:
                    c.join(e[1], e[2])
                elif code == MARK:
                    c.mark(e[1], e[2])
                elif code == THREAD:
                    c.thread(e[1], e[2])
                elif code == RESET:
                    c.reset(record_event=False)
                i += 1
            moved |= i > at[r]
            at[r] = i
            if i == len(evs):
                pending.discard(r)
        if pending and not moved:
            stuck = {r: events[r][at[r]] for r in pending}
            raise RuntimeError(f"replay cannot go on: ranks wait for transfers no rank issued: {stuck}")
    return clocks
