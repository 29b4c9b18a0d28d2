"""Lesson 00b's communication sections, per rank (``l00b_memory``'s docstring says what each one measures)::

    side_channel  values sent to rank 0 beside the training step: a blocking all_gather per micro-batch vs a
                  side channel (``toolkit.comm.side_channel``) waited at the end of the step
    buckets       DDP's bucket size swept on an emulated link (``toolkit.comm.bucketing``) and the real one

Each takes ``(ctx, cfg)`` with ``l00b_memory``'s resolved cfg.
"""
from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist

from toolkit.comm.bucketing import LinkEmulator, steady_exposed
from toolkit.comm.side_channel import SideChannel, blocking_gather
from toolkit.data import batches
from toolkit.models import GPT, lm_loss, preset
from toolkit.parallel.zero import adamw
from toolkit.runtime.bench import compare


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

    times = {"blocking": [], "side": []}
    ctx.barrier()
    for s in range(steps * 2):  # alternate, so both see the same machine load; the first of each is a warm-up
        mode = ("blocking", "side")[s % 2]
        ctx.barrier()
        t0 = time.perf_counter()
        train_step(s, mode, record=s >= 2)
        times[mode].append(time.perf_counter() - t0)
    spans = [sp for sp in ctx.timeline.to_json() if sp["meta"].get("mode") in ("blocking", "side")]
    # the training thread's time in communication: collecting the values (blocking: the all_gather; side: post
    # and the end-of-step collect) and the gradient all-reduce, where waiting for the slowest rank ends up
    # when the values no longer synchronise the ranks per micro-batch
    parts = {mode: {kind: sum(s["end"] - s["start"] for s in spans if s["meta"]["mode"] == mode and s["kind"] == kind)
                    for kind in (("collect",) if mode == "blocking" else ("post", "wait")) + ("allreduce",)}
             for mode in ("blocking", "side")}
    exposed = {mode: sum(p.values()) for mode, p in parts.items()}
    n_steps = {mode: len(v) - 1 for mode, v in times.items()}
    received.update(channel.collect())
    complete = None
    if ctx.rank == 0:
        complete = all(len(v) == ctx.world_size and v[0].shape == (cfg["batch"], seq, k) for v in received.values())
    channel.close()
    return {"step_s": {mode: sum(v[1:]) / max(len(v) - 1, 1) for mode, v in times.items()},
            "exposed_collect_s_per_step": {mode: (exposed[mode] - parts[mode]["allreduce"]) / max(n_steps[mode], 1)
                                           for mode in exposed},
            "exposed_comm_s_per_step": {mode: exposed[mode] / max(n_steps[mode], 1) for mode in exposed},
            "allreduce_s_per_step": {mode: parts[mode]["allreduce"] / max(n_steps[mode], 1) for mode in exposed},
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
    """DDP with each bucket size, on the emulated link (scaled to the measured backward time) and the real one."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    mc = preset(cfg["model"], n_layer=cfg["bucket_layers"])
    base = GPT(mc).to(ctx.device)
    data = list(batches(cfg["batch"], mc.seq_len, 4, seed=9, rank=ctx.rank, world=ctx.world_size, device=ctx.device))
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    n = ctx.world_size
    ids = None if ctx.device.type == "cpu" else [ctx.device.index]

    def make(cap_mb: float, emulator: LinkEmulator):
        model = DDP(copy.deepcopy(base), device_ids=ids, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
        model.register_comm_hook(None, emulator.hook)
        return model

    # calibrate: backward time without any communication (no_sync), median of a few
    local = make(25.0, LinkEmulator())
    bwd = []
    for i in range(5):
        x, y = data[i % len(data)]
        loss = local(x, y)
        with local.no_sync():
            t0 = time.perf_counter()
            loss.backward()
            bwd.append(time.perf_counter() - t0)
        local.zero_grad(set_to_none=True)
    backward_s = sorted(bwd)[len(bwd) // 2]
    t = torch.tensor([backward_s])
    dist.all_reduce(t)  # the same link on every rank
    backward_s = t.item() / n
    alpha = cfg["latency_ratio"] * backward_s
    beta = 2 * (n - 1) / n * grad_bytes / (cfg["comm_ratio"] * backward_s)
    out = {"grad_bytes": grad_bytes, "n_tensors": len(list(base.parameters())), "backward_s": backward_s,
           "alpha_s": alpha, "beta_bytes_per_s": beta, "links": {}}
    links = {"emulated": (alpha, beta), "real": (0.0, float("inf"))}
    for link in cfg["links"]:
        a, b = links[link]
        emus = {cap: LinkEmulator(a, b) for cap in cfg["bucket_mb"]}
        models = {cap: make(cap, emus[cap]) for cap in cfg["bucket_mb"]}
        for model in models.values():  # DDP rebuilds its buckets after the first step: do it before timing
            for x, y in data[:2]:
                model(x, y).backward()
                model.zero_grad(set_to_none=True)
        exposed = {cap: [] for cap in models}
        it = {cap: iter(data * 1000) for cap in models}
        last_spans = {}

        def stepper(cap):
            model, emu = models[cap], emus[cap]

            def fn():
                x, y = next(it[cap])
                emu.reset()
                loss = model(x, y)
                loss.backward()
                done = time.perf_counter()
                model.zero_grad(set_to_none=True)
                last_ready = max(s["ready"] for s in emu.spans)
                exposed[cap].append(done - last_ready)
                last_spans[cap] = [dict(s) for s in emu.spans] + [{"backward_done": done}]
            return fn

        with ctx.ledger.tag(f"buckets/{link}"):
            res = compare({cap: stepper(cap) for cap in models}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                          rounds=cfg["rounds"], sync=ctx.barrier)
        rows = []
        for cap in models:
            spans = last_spans[cap]
            timed = exposed[cap][cfg["warmup"]:]
            rows.append({"bucket_mb": cap, "buckets": len(spans) - 1,
                         "bucket_bytes": [s["bytes"] for s in spans[:-1]], "step_s": res[cap].mean_s,
                         "exposed_comm_s": sorted(timed)[len(timed) // 2],
                         "simulated_exposed_s": steady_exposed([s["bytes"] for s in spans[:-1]], backward_s,
                                                               n, a, b) if link == "emulated" else 0.0,
                         "spans": _relative(spans, ctx.timeline.origin)})
        out["links"][link] = rows
        del models
        gc.collect()
    del local
    gc.collect()
    return out


def _relative(spans: list[dict], origin: float) -> list[dict]:
    out = []
    for s in spans:
        out.append({k: (v - origin if k in ("ready", "start", "end", "backward_done") else v) for k, v in s.items()})
    return out
