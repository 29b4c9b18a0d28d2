"""Optimizer-state offload for the toolkit's ZeRO stages: AdamW's moments (and, in ``cpu`` mode, an fp32
master copy of the parameters) live in host memory, pinned on CUDA, instead of on the device.

Two ways to run the update, as ``OffloadAdamW(mode=...)``::

    mode "cpu"  (DeepSpeed ZeRO-Offload, offload_optimizer: cpu)      mode "stream"  (moments only)
    ──────────────────────────────────────────────────────────       ──────────────────────────────────────────
    device: param shard, grad shard                                   device: param shard, grad shard,
    host:   fp32 master, m, v, grad buffer                                    2 staging slots during the step
                                                                      host:   m, v
    step, for each shard i:                                           step, for each shard i:
      copy stream   D2H grad_i ──► host grad_i                          copy stream  H2D m_i+1, v_i+1 ─► slot (prefetch)
      host          AdamW(master_i, grad_i, m_i, v_i)                   compute      AdamW(p_i, g_i, slot m, slot v)
      copy stream   H2D master_i ──► param shard i                      copy stream  D2H slot ─► host m_i, v_i
    moved per step: D2H 4·S, H2D 4·S bytes                            moved per step: H2D 8·S, D2H 8·S bytes

(S = elements of this rank's shards, fp32.) In both modes the device holds no optimizer bytes between
steps; ``stream`` holds two shards' moments on the device while the step runs. On CUDA the copies run on
a side stream into pinned buffers, ordered against compute with events; on a CPU-only machine the
"device" is the CPU itself, the copies are plain ``copy_`` calls, and the host store is labelled
``host`` in the memory tracker (where it would live on a GPU machine).

The arithmetic is ``torch.optim.AdamW(foreach=False)``'s, one tensor at a time (``adamw_``): on the same
kind of processor the offloaded update is bitwise the in-memory one. ``cpu`` mode runs it on the host's
processor, so on a GPU machine it equals the GPU update only up to the last bits of the two processors'
kernels (``benchmarks/gpu/optim_offload.py`` measures by how much); ``stream`` runs it on the device.

Use it as the optimizer of a ``ZeroDataParallel``::

    zdp = ZeroDataParallel(model, lambda shards: OffloadAdamW(shards, mode="cpu"), stage=3)
"""
from __future__ import annotations

import contextlib

import torch
from torch.optim.adamw import adamw

from toolkit.runtime.memory import MemoryTracker

MODES = ("cpu", "stream")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
"""The defaults of ``toolkit.parallel.zero.adamw`` (torch's AdamW with lr=1e-3)."""


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
           lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: float = 1e-2) -> None:
    """AdamW step number ``step + 1`` in place on ``param``/``exp_avg``/``exp_avg_sq`` (any slice of them).

    The single-tensor path of ``torch.optim.AdamW(foreach=False)``: elementwise, so updating a tensor in
    pieces gives the same bits as updating it whole.
    """
    adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], foreach=False, fused=False,
          capturable=False, differentiable=False, amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
          weight_decay=weight_decay, eps=eps, maximize=False)


def on_host():
    """What is allocated inside is host memory (the AdamW temporaries of a host update, a spill's mapping),
    so an active ``MemoryTracker`` counts it as ``host``, not as a device category."""
    tracker = MemoryTracker.active()
    return tracker.categorize("host") if tracker is not None else contextlib.nullcontext()


class CopyEngine:
    """Host<->device copies: on CUDA on a side stream with events, elsewhere synchronous ``copy_``.

    Counts the bytes it moves each way (``h2d``: host store -> device side, ``d2h``: device side -> host
    store), by the copy's role: on a CPU-only machine both sides are RAM and the copies are memcpys.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.moved = {"h2d": 0, "d2h": 0}

    def host_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host buffer (pinned when the device is a GPU, so copies can be asynchronous)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.cuda)

    @contextlib.contextmanager
    def side(self):
        """Run the block's copies on the side stream (after the work already queued on the compute stream)."""
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """``dst.copy_(src)`` counted as ``direction`` (``"h2d"`` or ``"d2h"``; asynchronous on CUDA inside
        ``side()``)."""
        self.moved[direction] += src.numel() * src.element_size()
        dst.copy_(src, non_blocking=self.cuda)

    def event(self):
        """An event recorded on the current stream (None on CPU: everything already happened)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def join(self) -> None:
        """Make the compute stream wait for every copy issued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in host memory (see the module docstring for the two ``mode``\\ s).

    ``self.state`` stays empty: nothing a memory tracker would count as device optimizer state. The host
    store is ``self.host`` (one dict per parameter) and is reported by ``host_bytes()``.
    """

    def __init__(self, params, mode: str = "cpu", lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not an offload mode; allowed: {MODES}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.mode = mode
        self.params = [p for g in self.param_groups for p in g["params"]]
        device = self.params[0].device
        self.copies = CopyEngine(device)
        self.steps = 0
        self.host: list[dict[str, torch.Tensor]] = []
        for p in self.params:  # allocated here, not lazily in step(): a tracker must not see them as "optim"
            st = {"exp_avg": self.copies.host_empty(p.numel()), "exp_avg_sq": self.copies.host_empty(p.numel())}
            if mode == "cpu":
                st["master"] = self.copies.host_empty(p.numel())
                st["master"].copy_(p.detach().reshape(-1))  # the fp32 master starts as the parameter
                st["grad"] = self.copies.host_empty(p.numel())
            self.host.append(st)
        self.moved_per_step: list[dict[str, int]] = []
        self._classify_host()

    def _classify_host(self) -> None:
        tracker = MemoryTracker.active()
        if tracker is not None:
            self.register(tracker)

    def register(self, tracker: MemoryTracker) -> None:
        """Count the host store as ``host`` in ``tracker``."""
        for st in self.host:
            for t in st.values():
                tracker.register(t, "host")

    def host_bytes(self) -> dict[str, int]:
        """Bytes of the host store by role: ``optim`` (m, v), ``master``, ``grads`` (the D2H landing buffer)."""
        out = {"optim": 0, "master": 0, "grads": 0}
        for st in self.host:
            out["optim"] += sum(st[k].untyped_storage().nbytes() for k in ("exp_avg", "exp_avg_sq"))
            if "master" in st:
                out["master"] += st["master"].untyped_storage().nbytes()
                out["grads"] += st["grad"].untyped_storage().nbytes()
        return out

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s moments as host tensors (``exp_avg``, ``exp_avg_sq``; synchronizes on CUDA)."""
        if self.copies.cuda:
            torch.cuda.synchronize(self.copies.device)
        return {k: self.host[i][k] for k in ("exp_avg", "exp_avg_sq")}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadAdamW.step does not take a closure")
        before = dict(self.copies.moved)
        hyper = {k: self.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")}
        live = [(p, st) for p, st in zip(self.params, self.host) if p.grad is not None]
        (self._step_cpu if self.mode == "cpu" else self._step_stream)(live, hyper)
        self.steps += 1
        self.moved_per_step.append({k: self.copies.moved[k] - before[k] for k in before})

    def _step_cpu(self, live, hyper) -> None:
        c = self.copies
        events = []
        with c.side():  # all gradients leave at once; the host updates each as soon as it has landed
            for p, st in live:
                c.copy(st["grad"], p.grad.reshape(-1), "d2h")
                events.append(c.event())
        for (p, st), ev in zip(live, events):
            if ev is not None:
                ev.synchronize()
            with on_host():
                adamw_(st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"], self.steps, **hyper)
            with c.side():
                c.copy(p.detach().view(-1), st["master"], "h2d")
        c.join()

    def _step_stream(self, live, hyper) -> None:
        c = self.copies
        if not live:
            return
        width = max(p.numel() for p, _ in live)
        dev = live[0][0].device
        slots = [torch.empty(2, width, device=dev) for _ in range(2)]  # m, v of two shards: the step's device bytes
        loaded = [None] * len(live)

        def prefetch(i: int) -> None:
            p, st = live[i]
            slot = slots[i % 2]
            with c.side():
                c.copy(slot[0, :p.numel()], st["exp_avg"], "h2d")
                c.copy(slot[1, :p.numel()], st["exp_avg_sq"], "h2d")
                loaded[i] = c.event()

        prefetch(0)
        for i, (p, st) in enumerate(live):
            if i + 1 < len(live):
                prefetch(i + 1)  # the copy stream is in order: the slot's previous D2H is already ahead of it
            if loaded[i] is not None:
                torch.cuda.current_stream(dev).wait_event(loaded[i])
            m, v = slots[i % 2][0, :p.numel()], slots[i % 2][1, :p.numel()]
            adamw_(p.detach().view(-1), p.grad.reshape(-1), m, v, self.steps, **hyper)
            with c.side():
                c.copy(st["exp_avg"], m, "d2h")
                c.copy(st["exp_avg_sq"], v, "d2h")
        if c.cuda:
            for s in slots:
                s.record_stream(c.stream)
        c.join()

