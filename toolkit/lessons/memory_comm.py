"""Lesson 00b's communication sections, per rank (``l00b_memory``'s docstring says what each one measures)::

    side_channel  values sent to rank 0 beside the training step: a blocking all_gather per micro-batch vs a
                  side channel (``toolkit.comm.side_channel``) waited at the end of the step
    buckets       DDP's bucket size swept: the wall clock on gloo and, on the emulated cluster, the step and the
                  exposed all-reduce at the toy's shapes and matched to a real model, beside the closed form
                  (``toolkit.comm.bucketing``)

Each takes ``(ctx, cfg)`` with ``l00b_memory``'s resolved cfg.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from toolkit.comm.side_channel import SideChannel, blocking_gather
from toolkit.data import batches
from toolkit.models import GPT, lm_loss, preset
from toolkit.parallel.zero import adamw
from toolkit.runtime.bench import compare
from toolkit.runtime.cluster import Link


def _variable_batches(cfg: dict, seq_len: int, rank: int, world: int, steps: int, m: int, device):
    """``steps`` x ``m`` micro-batches of unequal length (uniform in [T/4, T], seeded per step, micro-batch
    and rank), so ranks do unequal work per micro-batch, as with variable-length data."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(max(seq_len // 4, 1), seq_len + 1, (steps, m, world), generator=g)
    data = batches(cfg["batch"], seq_len, steps * m, seed=12, rank=rank, world=world)
    out = []
    for s in range(steps):
        row = []
        for i in range(m):
            x, y = next(data)
            n = int(lengths[s, i, rank])
            row.append((x[:, :n].to(device), y[:, :n].to(device)))
        out.append(row)
    return out


def side_channel(ctx, cfg: dict) -> dict:
    """Gradient accumulation over ``m`` variable-length micro-batches; each micro-batch's top-k predictions go
    to rank 0, by a blocking all_gather right after its forward, or posted on a side channel."""
    torch.manual_seed(0)
    mc = preset(cfg["model"])
    model = GPT(mc).to(ctx.device)
    opt = adamw(list(model.parameters()))
    steps, m, k = cfg["steps"] + 1, cfg["m"], cfg["topk"]
    data = _variable_batches(cfg, mc.seq_len, ctx.rank, ctx.world_size, steps * 2, m, ctx.device)
    channel = SideChannel(dst=0)
    ctx.ledger.name_group(channel.group, "side")
    seq = mc.seq_len
    received = {}

    def topk(logits):  # [B, n, V] -> [B, seq, k] int64, padded to the full length with -1
        idx = logits.detach().topk(k, dim=-1).indices
        out = torch.full((logits.shape[0], seq, k), -1, dtype=torch.int64, device=logits.device)
        out[:, :idx.shape[1]] = idx
        return out

    def train_step(s: int, mode: str, record: bool):
        for i, (x, y) in enumerate(data[s]):
            with ctx.timeline.span("F", mb=i, mode=mode, step=s) if record else _null():
                logits = model(x)
                loss = lm_loss(logits, y)
            with ctx.timeline.span("collect" if mode == "blocking" else "post", mb=i, mode=mode, step=s) \
                    if record else _null():
                if mode == "blocking":
                    got = blocking_gather(topk(logits))
                    if ctx.rank == 0:
                        received[(mode, s, i)] = got
                else:
                    channel.post(topk(logits), label=(mode, s, i))
            with ctx.timeline.span("B", mb=i, mode=mode, step=s) if record else _null():
                (loss / m).backward()
            if i == m - 1:  # data parallel: average the accumulated gradients once per step; a blocking
                # collective, so a rank that finished its micro-batches early waits here for the slowest
                with ctx.timeline.span("allreduce", mode=mode, step=s) if record else _null():
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(ctx.world_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "side":  # the previous side step's values: arrived long ago, nobody waits for this step's
            with ctx.timeline.span("wait", mode=mode, step=s) if record else _null():
                got = channel.collect(leave=m)
            received.update(got)

    calls = iter(range(len(data)))  # one data row per step; the first two (one per mode) are compare's warm-up

    def step(mode: str):
        s = next(calls)
        train_step(s, mode, record=s >= 2)

    with ctx.paused():  # the wall clock only: nothing here reads the emulated cluster's
        bench = compare({mode: (lambda mode=mode: step(mode)) for mode in ("blocking", "side")}, warmup=1, steps=1,
                        rounds=cfg["steps"], trim=0, sync=ctx.barrier)
    spans = [sp for sp in ctx.timeline.to_json() if sp["meta"].get("mode") in ("blocking", "side")]
    # the training thread's time in communication: collecting the values (blocking: the all_gather; side: post
    # and the end-of-step collect) and the gradient all-reduce, where waiting for the slowest rank ends up
    # when the values no longer synchronise the ranks per micro-batch
    kinds = {"blocking": ("collect", "allreduce"), "side": ("post", "wait", "allreduce")}
    per_step = {mode: {} for mode in kinds}  # mode -> step -> kind -> seconds
    for sp in spans:
        mode = sp["meta"]["mode"]
        by_kind = per_step[mode].setdefault(sp["meta"]["step"], dict.fromkeys(kinds[mode], 0.0))
        if sp["kind"] in by_kind:
            by_kind[sp["kind"]] += sp["end"] - sp["start"]
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    exposed = {mode: [sum(k.values()) for k in steps.values()] for mode, steps in per_step.items()}
    allreduce = {mode: [k["allreduce"] for k in steps.values()] for mode, steps in per_step.items()}
    received.update(channel.collect())
    complete = None
    if ctx.rank == 0:
        complete = all(len(v) == ctx.world_size and v[0].shape == (cfg["batch"], seq, k) for v in received.values())
    channel.close()
    return {"bench": {mode: r.to_dict() for mode, r in bench.items()},
            # the exposed communication of each timed step, in compare's rounds: a BenchResult's shape, so
            # bench.verdict judges it the way it judges the step
            "exposed_comm": {mode: {"round_means_s": exposed[mode], "clock": "wall"} for mode in kinds},
            "exposed_collect_s_per_step": {mode: mean(exposed[mode]) - mean(allreduce[mode]) for mode in kinds},
            "exposed_comm_s_per_step": {mode: mean(exposed[mode]) for mode in kinds},
            "allreduce_s_per_step": {mode: mean(allreduce[mode]) for mode in kinds},
            "spans": spans, "received_values": len(received) if ctx.rank == 0 else None,
            "all_received_complete": complete, "payload_bytes": cfg["batch"] * seq * k * 8,
            "side_bytes_posted": channel.bytes_posted, "micro_batch_lengths": [[x.shape[1] for x, _ in row]
                                                                               for row in data]}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def buckets(ctx, cfg: dict) -> dict:
    """DDP with each bucket size of ``cfg["bucket_mb"]``, timed on gloo (wall clock) and, when the launch runs on
    an emulated cluster, on its virtual clock: the step and the all-reduce left exposed after backward, at the
    toy's own shapes and matched to ``cfg["stands_for"]``'s gradient and backward, each beside the closed form of
    the same link (``bucketing.steady_exposed``: gradients produced at a steady rate over the backward)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    mc = preset(cfg["model"], n_layer=cfg["bucket_layers"])
    base = GPT(mc).to(ctx.device)
    data = list(batches(cfg["batch"], mc.seq_len, 4, seed=9, rank=ctx.rank, world=ctx.world_size, device=ctx.device))
    emu, n = ctx.emulator, ctx.world_size
    ids = None if ctx.device.type == "cpu" else [ctx.device.index]
    elem = next(base.parameters()).element_size()
    sizes: dict[float, list[int]] = {}  # per bucket size: the bytes of each bucket, in the order DDP reduces them

    def make(cap: float):
        model = DDP(copy.deepcopy(base), device_ids=ids, bucket_cap_mb=cap, gradient_as_bucket_view=True)
        reduce = emu.ddp_hook if emu is not None else allreduce_hook  # both through the ledger; the first also
        # moves the virtual clock: the all-reduce is issued at the bucket's virtual time, waited when backward ends

        def hook(state, bucket):  # no annotations: DDP checks them against Future[Tensor] objects
            sizes[cap].append(bucket.buffer().numel() * elem)
            return reduce(state, bucket)
        model.register_comm_hook(None, hook)
        for x, y in data[:2]:  # DDP rebuilds its buckets after the first step: do it before timing
            sizes[cap] = []
            model(x, y).backward()
            model.zero_grad(set_to_none=True)
        return model

    models = {cap: make(cap) for cap in cfg["bucket_mb"]}
    last: dict[float, dict] = {}  # per bucket size: its last step on the virtual clock

    def stepper(cap: float):
        model, it = models[cap], iter(data * 1000)

        def step():
            x, y = next(it)
            sizes[cap] = []
            first, t0 = (len(emu.comms), emu.now()) if emu is not None else (0, 0.0)
            model(x, y).backward()
            if emu is not None:
                last[cap] = _virtual_step(emu, first, t0)
            model.zero_grad(set_to_none=True)
        return step

    with ctx.ledger.tag("buckets/toy"), ctx.paused():  # wall time only: the virtual clock times one step each below
        res = compare({cap: stepper(cap) for cap in models}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                      rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress)
    out = {"grad_bytes": sum(p.numel() * elem for p in base.parameters()), "n_tensors": len(list(base.parameters())),
           "rows": [{"bucket_mb": cap, "buckets": len(sizes[cap]), "bucket_bytes": list(sizes[cap]),
                     "step_s": res[cap].mean_s} for cap in models], "emulated": None}
    if emu is None:
        return out

    # ---- on the emulated cluster: the toy's own shapes, then matched to the real model's gradient and backward --
    from toolkit.models import catalog, matched
    from toolkit.comm.bucketing import steady_exposed
    from toolkit.runtime import collectives
    hw = emu.cluster
    link = hw.link_between(list(range(n)), n)
    real = catalog.get(cfg["stands_for"])
    tokens = cfg["batch"] * mc.seq_len
    real_op = matched.dp_grad_op(real.params(), real.seq_len, hw.float_bytes)
    scales = matched.matched_scales(matched.dp_grad_op(out["grad_bytes"] / elem, tokens, hw.float_bytes), real_op)

    def target_bytes(cap: float, byte_scale: float) -> list[float]:
        """The bucket's bytes on the target: its elements at ``float_bytes`` (bf16), times the byte scale."""
        return [b / elem * hw.float_bytes * byte_scale for b in sizes[cap]]

    def on_link(wire: float) -> float:  # the world's all-reduce, as the emulated cluster times it
        return collectives.seconds(hw, "all_reduce", range(n), n, wire)[0]

    def in_node(wire: float) -> float:  # the same ranks inside one node
        return collectives.fastest(hw.intra, "all_reduce", n, wire)[0]

    def closed_form(cap: float, backward_s: float, byte_scale: float, transfer) -> float:
        return steady_exposed(target_bytes(cap, byte_scale), backward_s, n, transfer)

    # one step each on the virtual clock, started from clocks a barrier aligned (compare's sync): deterministic,
    # so one stands for every round (as the matched steps below)
    with ctx.ledger.tag("buckets/toy"):
        toy = compare({cap: stepper(cap) for cap in models}, warmup=0, steps=1, rounds=1, sync=ctx.barrier,
                      clock="virtual")
    backward = _virtual_backward(ctx, emu, models[cfg["bucket_mb"][0]], *data[0])
    E = {"cluster": hw.name, "gpu": hw.gpu.name, "link": _link(link), "intra": _link(hw.intra),
         "nodes": n // hw.per_node(n), "float_bytes": hw.float_bytes, "host_op_s": hw.gpu.efficiency.host_op_s,
         "backward_s": backward, "rows": []}
    for cap in models:
        v = last[cap]
        E["rows"].append({"bucket_mb": cap, "step_s": toy[cap].mean_s, "exposed_s": v["exposed_s"],
                          "closed_form_exposed_s": closed_form(cap, backward, 1.0, on_link),
                          "closed_form_intra_exposed_s": closed_form(cap, backward, 1.0, in_node),
                          "spans": v["spans"], "backward_end_s": v["backward_end_s"]})
    with emu.scaled(**scales), ctx.ledger.tag("buckets/matched"):
        backward_m = _virtual_backward(ctx, emu, models[cfg["bucket_mb"][0]], *data[0])
        matched = []
        for cap in models:  # the virtual clock is deterministic: one step each
            ctx.barrier()
            stepper(cap)()
            matched.append({"bucket_mb": cap, "real_bucket_mb": max(target_bytes(cap, scales["bytes"])) / 2**20,
                            "step_s": last[cap]["step_s"], "exposed_s": last[cap]["exposed_s"],
                            "closed_form_exposed_s": closed_form(cap, backward_m, scales["bytes"], on_link),
                            "closed_form_intra_exposed_s": closed_form(cap, backward_m, scales["bytes"], in_node)})
    grad = real_op["wire_bytes"]
    E["matched"] = {"stands_for": cfg["stands_for"], "scales": scales, "backward_s": backward_m,
                    "backward_gemm_s": real_op["gemm_flops"] / (hw.gpu.bf16_flops * hw.gpu.efficiency.gemm), "grad_bytes": grad,
                    "rows": matched, "closed_form_real": _closed_form_sweep(grad, backward_m, n, on_link, in_node)}
    out["emulated"] = E
    return out


REAL_BUCKET_MB = [2 ** i for i in range(0, 19)]
"""Bucket sizes (MiB) of the closed form at the real model's scale: 1 MiB up to one bucket for the gradient."""


def _closed_form_sweep(grad_bytes: float, backward_s: float, n: int, on_link, in_node) -> list[dict]:
    """``steady_exposed`` of a ``grad_bytes`` gradient cut into equal buckets of each ``REAL_BUCKET_MB`` (the last
    one smaller), with the all-reduce times ``on_link`` and ``in_node`` (``bucketing.TransferTime``), up to the
    first size that holds the whole gradient."""
    from toolkit.comm.bucketing import steady_exposed
    rows = []
    for mb in REAL_BUCKET_MB:
        full, rest = divmod(grad_bytes, mb * 2**20)
        sizes = [mb * 2**20] * int(full) + ([rest] if rest else [])
        rows.append({"bucket_mb": mb, "exposed_s": steady_exposed(sizes, backward_s, n, on_link),
                     "intra_exposed_s": steady_exposed(sizes, backward_s, n, in_node)})
        if len(sizes) == 1:
            break
    return rows


def _link(link) -> dict:
    return {"name": link.name, "bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}


def _virtual_backward(ctx, emu, model, x, y) -> float:
    """The backward's virtual time with no all-reduce (``no_sync`` around forward too: DDP decides there)."""
    ctx.barrier()
    with model.no_sync():
        loss = model(x, y)
        emu.synchronize()
        t0 = emu.now()
        loss.backward()
        emu.synchronize()
        took = emu.now() - t0
    model.zero_grad(set_to_none=True)
    return took


def _virtual_step(emu, first: int, t0: float) -> dict:
    """A forward and backward that began at virtual ``t0``, its all-reduces the emulator's records from index
    ``first``: the step so far, the time the end-of-backward waits moved the clock (exposed), and each bucket on
    the link (issued when its last gradient was ready, on the link from start to end), relative to ``t0``."""
    recs = [c for c in emu.comms[first:] if c["op"] == "all_reduce"]
    now = emu.now()
    exposed = sum(c["exposed"] or 0.0 for c in recs)
    return {"step_s": now - t0, "exposed_s": exposed, "backward_end_s": now - exposed - t0,
            "spans": [{"bucket": i, "ready": c["issue"] - t0, "start": c["start"] - t0, "end": c["local_end"] - t0,
                       "bytes": c["bytes"]} for i, c in enumerate(recs)]}
