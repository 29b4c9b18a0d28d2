"""The emulated cluster's mechanics checked on real processes: each case runs real ops and reports the virtual times.

``tests/test_emulator.py`` asserts relations between the times of one run (a late rank delays a collective by its
lateness; overlap hides the shorter of two and costs the compute some SMs; two transfers share a link), never
the model's own formulas; ``tests/test_calibration.py`` checks the model's figures against published
measurements. Every case starts from clocks aligned by a barrier::

    ops          send/recv, all_reduce, all_gather, reduce_scatter, all_to_all at 3 sizes, on a group inside a
                 node (intra link) and on the world group, which spans nodes (inter link)
    skew         rank 1 computes a matmul first (its time measured alone); the all_reduce completes that much later
    async        an all_reduce issued before a matmul, waited after it, beside the matmul alone
    sharing      two all_reduces issued back to back: the second waits for the first on the rank's link
    exchange     a matmul, then a send to and a receive from the other rank of the node, three times: the same
                 virtual time at 2 ranks (one node) and at 4 (two nodes), whatever the machine's load
    pipeline     ``pipeline(ctx, cfg)``: schedules run by the executor, per-action virtual durations and step time,
                 for ``toolkit.pipeline.simulate`` to be fed the same op times
    host         ``host(ctx, cfg)``: a long matmul, then the host reads a value (``host_read``) or not, then a
                 short matmul: the read makes the host wait for the stream; and ``paused()``: the clock stands still

Without an emulated cluster the same programs run (``virtual`` entries are then absent): their ``checksum`` of
every tensor the ops produced must be bitwise the emulated run's.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from toolkit.runtime import compat

SIZES = (1024, 262144, 4194304)  # bytes of the payload (float32): 1 KiB, 256 KiB, 4 MiB
OPS = ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MATMUL_N = (256, 2048)  # a short matmul (under one transfer) and a long one


class _Digest:
    """A running hash of tensors (their bytes), to compare runs bitwise."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, t: torch.Tensor) -> None:
        self.h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _now(ctx) -> float | None:
    return ctx.emulator.now() if ctx.emulator is not None else None


def _elapsed(ctx, fn) -> float | None:
    """Virtual seconds ``fn()`` takes on this rank, from clocks aligned by a world barrier (None: no emulator).
    Inputs are built before, outputs hashed after: the time is the ops' alone."""
    dist.barrier()
    t0 = _now(ctx)
    fn()
    return None if t0 is None else _now(ctx) - t0


def _group_op(op: str, group, n: int, numel: int) -> tuple:
    """(inputs, call, outputs) of one ``op`` in ``group`` (n ranks), float32 payloads of ``numel`` elements (the
    op's full buffer)."""
    me = dist.get_rank()
    if op == "all_reduce":
        x = torch.arange(numel, dtype=torch.float32) + me
        return (lambda: dist.all_reduce(x, group=group)), [x]
    if op == "all_gather":
        out, x = torch.empty(numel), torch.full((numel // n,), float(me))
        return (lambda: compat.all_gather_single(out, x, group=group)), [out]
    if op == "reduce_scatter":
        out, x = torch.empty(numel // n), torch.arange(numel, dtype=torch.float32)
        return (lambda: compat.reduce_scatter_single(out, x, group=group)), [out]
    if op == "all_to_all":
        out, x = torch.empty(numel), torch.arange(numel, dtype=torch.float32) * (me + 1)
        return (lambda: dist.all_to_all_single(out, x, group=group)), [out]
    raise ValueError(op)


def _p2p(pairs: list[tuple[int, int]], numel: int) -> tuple:
    """Each (src, dst) pair sends ``numel`` float32 once (blocking send and recv)."""
    me = dist.get_rank()
    x = torch.full((numel,), float(me))
    def call():
        for src, dst in pairs:
            if me == src:
                dist.send(x, dst)
            elif me == dst:
                dist.recv(x, src)
    return call, [x]


def _operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matmul's operand and output, [n, n] float32."""
    return torch.ones(n, n) / n, torch.empty(n, n)


def run(ctx, cfg):
    """Cases ops, skew, async, sharing and ring (module docstring), on 4 ranks (2 nodes of 2 on the cluster)."""
    if ctx.world_size != 4:
        raise ValueError(f"the emulator checks run on 4 ranks (2 nodes of 2), got world_size={ctx.world_size}")
    digest, rank = _Digest(), ctx.rank
    node = dist.new_group([0, 1]), dist.new_group([2, 3])
    pair = node[rank // 2]  # the group inside this rank's node
    out = {"ops": [], "matmul_n": list(MATMUL_N)}
    for size in SIZES:
        numel = size // 4
        for where, group, n, peers in (("intra", pair, 2, [(0, 1), (2, 3)]), ("inter", None, 4, [(0, 2), (1, 3)])):
            for op in OPS:
                call, results = _p2p(peers, numel) if op == "send" else _group_op(op, group, n, numel)
                out["ops"].append({"op": op, "link": where, "n": n, "bytes": size, "virtual_s": _elapsed(ctx, call)})
                for t in results:
                    digest.add(t)
    size = SIZES[-1]
    x, y = {n: _operands(n) for n in MATMUL_N}, torch.ones(size // 4)
    # skew: rank 1 computes the large matmul first, then the two ranks of each node all-reduce 4 MiB
    late = {}
    def skew():
        if rank == 1:
            a, c = x[MATMUL_N[1]]
            t0 = _now(ctx)
            torch.mm(a, a, out=c)
            late["s"] = None if t0 is None else _now(ctx) - t0
        dist.all_reduce(y, group=pair)
    out["skew_s"] = _elapsed(ctx, skew)
    out["late_s"] = late.get("s")
    # each matmul alone, from aligned clocks
    out["matmul_s"] = {str(n): _elapsed(ctx, lambda n=n: torch.mm(x[n][0], x[n][0], out=x[n][1])) for n in MATMUL_N}
    # async: an all_reduce issued, then a short or a long matmul, then waited
    out["async_s"] = {}
    for n in MATMUL_N:
        def overlapped(n=n):
            work = dist.all_reduce(y, group=pair, async_op=True)
            torch.mm(x[n][0], x[n][0], out=x[n][1])
            work.wait()
        out["async_s"][str(n)] = _elapsed(ctx, overlapped)
    # sharing: two all_reduces issued together; the times to the first's and to the second's completion
    z, marks = torch.ones(size // 4) * 2, {}
    def two():
        t0 = _now(ctx)
        wy, wz = dist.all_reduce(y, group=pair, async_op=True), dist.all_reduce(z, group=pair, async_op=True)
        wy.wait()
        marks["first"] = None if t0 is None else _now(ctx) - t0
        wz.wait()
        marks["second"] = None if t0 is None else _now(ctx) - t0
    _elapsed(ctx, two)
    out["sharing_s"] = marks
    for n in MATMUL_N:
        digest.add(x[n][1])
    digest.add(y)
    digest.add(z)
    out["exchange_s"] = exchange(ctx, cfg)["exchange_s"]
    out["checksum"] = digest.hexdigest()
    out["totals"] = ctx.emulator.totals() if ctx.emulator is not None else None
    out["op_times"] = ctx.emulator.report()["ops"] if ctx.emulator is not None else None  # modelled vs this CPU
    return out


def exchange(ctx, cfg):
    """Three rounds of: a large matmul, then 256 KiB sent to and received from the other rank of the node
    (rank ^ 1), by ``batch_isend_irecv``."""
    r = ctx.rank
    (a, c), x, y = _operands(MATMUL_N[1]), torch.full((SIZES[1] // 4,), float(r)), torch.empty(SIZES[1] // 4)
    def rounds():
        for _ in range(3):
            torch.mm(a, a, out=c)
            ops = [dist.P2POp(dist.isend, x, r ^ 1), dist.P2POp(dist.irecv, y, r ^ 1)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    digest = _Digest()
    seconds = _elapsed(ctx, rounds)
    digest.add(y)
    return {"exchange_s": seconds, "checksum": digest.hexdigest()}


def host(ctx, cfg):
    """A long matmul, then ``host_read`` of 4 int64 (or a plain ``tolist()``, which dispatches nothing), then a short
    matmul: the virtual seconds of each; then a matmul and an all_reduce inside ``paused()``: the clock's move, the
    calls the ledger counted and a checksum of the results."""
    from toolkit.runtime.emulator import host_read
    (a, c), (b, d), counts = _operands(MATMUL_N[1]), _operands(MATMUL_N[0]), torch.arange(4)
    out = {}
    for name, read in (("host_read", host_read), ("tolist", lambda t: t.tolist())):
        def sequence(read=read):
            torch.mm(a, a, out=c)
            read(counts)
            torch.mm(b, b, out=d)
        out[f"{name}_s"] = _elapsed(ctx, sequence)
    y = torch.full((SIZES[0] // 4,), float(ctx.rank))
    dist.barrier()
    t0, calls = _now(ctx), len(ctx.ledger.records)
    with ctx.paused():
        torch.mm(a, a, out=c)
        dist.all_reduce(y)
    out["paused_moved_s"] = None if t0 is None else _now(ctx) - t0
    out["paused_calls"] = len(ctx.ledger.records) - calls
    digest = _Digest()
    for t in (c, d, y):
        digest.add(t)
    out["checksum"] = digest.hexdigest()
    return out


def pipeline(ctx, cfg):
    """Each schedule of ``cfg["schedules"]`` at p = world size, m = 2p, run by the executor (one checked step, one
    timed step): its spans (virtual times when emulated), step time, loss and a checksum of its gradients."""
    from toolkit.pipeline.harness import Job, PipelineSetup, measure_schedules
    from toolkit.pipeline.schedule import make_schedule
    p = ctx.world_size
    setup = PipelineSetup.build("smoke", m=2 * p, micro_batch=2, n_layer=2 * p, seed=0, device=ctx.device, d_model=64)
    out = {"act_shape": list(setup.act_shape)}
    for i, name in enumerate(cfg["schedules"]):
        with ctx.part(i, len(cfg["schedules"]), name):  # the bar: one slice per schedule (it counts its own steps)
            records, models = measure_schedules(ctx, setup, [Job(make_schedule(name, p, 2 * p))], warmup=1, steps=1,
                                                rounds=1, trim=0)
        rec, digest = records[0], _Digest()
        for param in models[0].parameters():
            if param.grad is not None:
                digest.add(param.grad)
        out[name] = {"loss": rec["loss"], "grads": digest.hexdigest(),
                     "spans": [{"op": s["kind"], "stage": s["meta"]["stage"], "mb": s["meta"]["mb"],
                                "chunk": s["meta"]["chunk"], "virtual_s": s["vend"] - s["vstart"]}
                               for s in rec["spans"] if "vstart" in s],
                     "step_s": rec["bench"]["virtual"]["mean_s"] if rec["bench"].get("virtual") else None}
    return out


def replayed(ctx, cfg):
    """A mixed job (matmuls, an async all_reduce under compute, a send and a receive, a host copy waited for) timed
    live, then re-timed from every rank's trace at the same figures and on ``cfg["other"]`` (a ``Cluster.to_dict``,
    or None: the same): the job's span over the ranks, live and replayed (``toolkit.runtime.vclock.replay``)."""
    from toolkit.runtime.cluster import Cluster
    from toolkit.runtime.emulator import sensitivity
    emu = ctx.emulator
    (a, c), y = _operands(MATMUL_N[1]), torch.ones(SIZES[-1] // 4)
    dist.barrier()
    t0 = emu.mark("start")
    for _ in range(2):
        work = dist.all_reduce(y, async_op=True)
        torch.mm(a, a, out=c)
        work.wait()
        if ctx.rank == 0:
            dist.send(y, 1)
        else:
            dist.recv(y, 0)
        copy = emu.host_copy(y.numel() * 4, to_host=True)
        torch.mm(a, a, out=c)
        copy.wait()
    live = torch.tensor([emu.mark("end") - t0], dtype=torch.float64)
    with ctx.paused():
        dist.all_reduce(live, op=dist.ReduceOp.MAX)

    def span(clocks) -> float:
        return max(k.marks_named("end")[0] - k.marks_named("start")[0] for k in clocks)
    traces = emu.traces()
    holder = [None]
    if ctx.rank == 0:
        other = Cluster.from_dict(cfg["other"]) if cfg.get("other") else emu.cluster
        got = sensitivity(traces, emu.cluster, span, band={"other": (1.0, 1.0)})
        holder = [{"same": got["value"], "other": sensitivity(traces, other, span, band={})["value"]}]
    with ctx.paused():
        dist.broadcast_object_list(holder, src=0)
    return {"live": live.item(), "replayed_same": holder[0]["same"], "replayed_other": holder[0]["other"]}
