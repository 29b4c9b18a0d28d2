"""Optimizer-state offload for the toolkit's ZeRO stages: AdamW's moments (and, in ``cpu`` mode, an fp32
master copy of the parameters) live in host memory, pinned on CUDA, instead of on the device.

Two ways to run the update, as ``OffloadAdamW(mode=...)``::

    mode "cpu"  (DeepSpeed ZeRO-Offload, offload_optimizer: cpu)      mode "stream"  (moments only)
    ──────────────────────────────────────────────────────────       ──────────────────────────────────────────
    device: param shard                                               device: param shard, grad shard,
    host:   fp32 master, m, v, grad shard                                     2 staging slots during the step
                                                                      host:   m, v
    backward, as each grad shard is produced:                         step, for each shard i:
      copy stream   D2H grad_i ──► host grad_i; device grad freed       copy stream  H2D m_i+1, v_i+1 ─► slot (prefetch)
    step, for each shard i:                                             compute      AdamW(p_i, g_i, slot m, slot v)
      host          AdamW(master_i, grad_i, m_i, v_i)                   copy stream  D2H slot ─► host m_i, v_i
      copy stream   H2D master_i ──► param shard i
    moved per step: D2H 4·S, H2D 4·S bytes                            moved per step: H2D 8·S, D2H 8·S bytes

(S = elements of this rank's shards, fp32.) In both modes the device holds no optimizer bytes between
steps; ``stream`` holds two shards' moments on the device while the step runs. ``cpu`` mode, as ZeRO-Offload,
also keeps no gradient shard on the device: a post-accumulate-grad hook sends each shard down as soon as
backward has produced it (reduce-scattered, for ZeRO 2 and 3), so the copies run under the rest of backward,
and accumulates later micro-batches' gradients on the host. A gradient set by hand (ZeRO-1 reduces in
``step``) goes down at the step. On CUDA the copies run on a side stream into pinned buffers, ordered
against compute with events; on a CPU-only machine the "device" is the CPU itself, the copies are plain
``copy_`` calls, and the host store is labelled ``host`` in the memory tracker (where it would live on a
GPU machine).

On an emulated cluster every copy is a transfer on the host link (``toolkit.runtime.portable.HostIO``:
parameters and gradients at the target's float size, the fp32 optimizer state at 4 bytes), the host update
runs on the cluster's CPU (``host_compute``, its fp32 tensors at 4 bytes per element), and each
wait is the one the CUDA code makes: the host waits for a gradient before updating it, the stream waits for
the parameters before the next forward. ``vstats`` then has the step's virtual times.

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
from toolkit.runtime.portable import HostIO, Transfer, VirtualStep, host_compute

MODES = ("cpu", "stream")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
"""The defaults of ``toolkit.parallel.zero.adamw`` (torch's AdamW with lr=1e-3)."""
STATE_BYTES = 4
"""Bytes per element of the optimizer's state (fp32 master, m, v) on any target: mixed precision keeps it fp32."""


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


@contextlib.contextmanager
def host_update():
    """An optimizer update on the host's processor: its allocations are ``host`` memory (``on_host``), its fp32
    tensors at ``STATE_BYTES`` per element (``host_compute``)."""
    with on_host(), host_compute(STATE_BYTES):
        yield


class CopyEngine:
    """Host<->device copies: on CUDA on a side stream with events, elsewhere synchronous ``copy_``.

    Counts the bytes it moves each way (``h2d``: host store -> device side, ``d2h``: device side -> host
    store), by the copy's role: on a CPU-only machine both sides are RAM and the copies are memcpys. ``copy``
    returns the copy's ``Transfer`` (on an emulated cluster timed on the host link; its ``wait()`` /
    ``wait_host()`` are the waits a CUDA event stands for).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.io = HostIO()
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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, state: bool = False,
             after: float = 0.0) -> Transfer:
        """``dst.copy_(src)`` counted as ``direction`` (``"h2d"`` or ``"d2h"``; asynchronous on CUDA inside
        ``side()``): its transfer, of ``state`` (optimizer state: fp32 on the target too) or of the model's
        floats at the target's size, starting no earlier than ``after``."""
        self.moved[direction] += src.numel() * src.element_size()
        with self.io.to_host(after) if direction == "d2h" else self.io.to_device(after) as transfer:
            dst.copy_(src, non_blocking=self.cuda)
            transfer.add(src.numel() * STATE_BYTES if state else self.io.nbytes(src.numel(), src.dtype))
        return transfer

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
    store is ``self.host`` (one dict per parameter) and is reported by ``host_bytes()``. ``moved_per_step``: the
    bytes copied each way since the previous step (a ``cpu``-mode gradient goes down during backward);
    ``vstats``: per step on an emulated cluster, its virtual seconds (``VirtualStep``), else empty.
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
        self.vstats: list[dict] = []
        self._moved_mark = dict(self.copies.moved)
        # cpu mode: the gradients already on the host this step, by parameter: (event or transfer of the copy)
        self._landed: dict[int, object] = {}
        if mode == "cpu":
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_to_host(i, p))
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
        """Bytes of the host store by role: ``optim`` (m, v), ``master``, ``grads`` (the gradient shards)."""
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients, the ones already on the host included."""
        super().zero_grad(set_to_none)
        self._landed.clear()

    # ---- cpu mode: each gradient shard leaves the device as soon as backward has produced it ---------------
    @torch.no_grad()
    def _grad_to_host(self, i: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: copy ``p.grad`` into the host's gradient shard (the first micro-batch of a
        step) or add it there (later ones), then free it on the device."""
        if p.grad is None:  # backward gave this parameter no gradient (ZeRO-1 sets its shard's in step)
            return
        c, st, grad = self.copies, self.host[i], p.grad.reshape(-1)
        if i not in self._landed:
            with c.side():
                landed = c.copy(st["grad"], grad, "d2h")
                self._landed[i] = c.event() if c.cuda else landed
        else:  # accumulate on the host: what AccumulateGrad would add on the device, in the same order
            self._wait_landed(i, None)
            with on_host():
                staging = c.host_empty(grad.numel())
            with c.side():
                landed = c.copy(staging, grad, "d2h")
                ev = c.event()
            if ev is not None:
                ev.synchronize()
            landed.wait_host()
            with host_update():
                st["grad"].add_(staging)
            self._landed[i] = None
        if c.cuda:
            p.grad.record_stream(c.stream)  # its memory is reused only once the side stream has copied it
        p.grad = None

    def _wait_landed(self, i: int, clock: VirtualStep | None) -> None:
        """The host waits until parameter ``i``'s gradient has arrived in its host shard."""
        landed = self._landed.get(i)
        if isinstance(landed, torch.cuda.Event):
            landed.synchronize()
        elif landed is not None:
            if clock is not None:
                clock.wait(landed, "grad_wait_s", host=True)
            else:
                landed.wait_host()
        self._landed[i] = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadAdamW.step does not take a closure")
        hyper = {k: self.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")}
        clock = self.copies.io.virtual_step(("grad_wait_s", "param_wait_s") if self.mode == "cpu" else
                             ("moments_in_wait_s", "moments_out_wait_s"))
        (self._step_cpu if self.mode == "cpu" else self._step_stream)(hyper, clock)
        self.steps += 1
        moved = self.copies.moved
        self.moved_per_step.append({k: moved[k] - self._moved_mark[k] for k in moved})
        self._moved_mark = dict(moved)
        v = clock.done()
        if v is not None:
            self.vstats.append(v)

    def _step_cpu(self, hyper, clock: VirtualStep) -> None:
        c = self.copies
        for i, p in enumerate(self.params):  # gradients set outside backward (ZeRO-1's reduce in step) go now
            if p.grad is not None:
                self._grad_to_host(i, p)
        live = [i for i in range(len(self.params)) if i in self._landed]
        ups = []
        for i in live:  # the host updates each shard as soon as its gradient has landed
            st = self.host[i]
            self._wait_landed(i, clock)
            with host_update():
                adamw_(st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"], self.steps, **hyper)
            with c.side():
                ups.append(c.copy(self.params[i].detach().view(-1), st["master"], "h2d"))
        self._landed.clear()
        c.join()
        for up in ups:  # the next forward reads the parameters: the stream waits for them
            clock.wait(up, "param_wait_s", host=False)

    def _step_stream(self, hyper, clock: VirtualStep) -> None:
        c = self.copies
        live = [(p, st) for p, st in zip(self.params, self.host) if p.grad is not None]
        if not live:
            return
        width = max(p.numel() for p, _ in live)
        dev = live[0][0].device
        slots = [torch.empty(2, width, device=dev) for _ in range(2)]  # m, v of two shards: the step's device bytes
        loaded = [None] * len(live)
        saved: list[Transfer | None] = [None] * len(live)  # the D2H copy of each shard's moments (frees its slot)

        def prefetch(i: int) -> None:
            p, st = live[i]
            slot = slots[i % 2]
            after = saved[i - 2].end if i >= 2 else 0.0  # the slot's last D2H
            with c.side():
                c.copy(slot[0, :p.numel()], st["exp_avg"], "h2d", state=True, after=after)
                up = c.copy(slot[1, :p.numel()], st["exp_avg_sq"], "h2d", state=True, after=after)
                loaded[i] = c.event() if c.cuda else up

        prefetch(0)
        for i, (p, st) in enumerate(live):
            if i + 1 < len(live):
                prefetch(i + 1)  # the copy stream is in order: the slot's previous D2H is already ahead of it
            if c.cuda:
                torch.cuda.current_stream(dev).wait_event(loaded[i])
            else:
                clock.wait(loaded[i], "moments_in_wait_s", host=False)  # the update reads the moments
            m, v = slots[i % 2][0, :p.numel()], slots[i % 2][1, :p.numel()]
            adamw_(p.detach().view(-1), p.grad.reshape(-1), m, v, self.steps, **hyper)
            with c.side():
                c.copy(st["exp_avg"], m, "d2h", state=True)
                saved[i] = c.copy(st["exp_avg_sq"], v, "d2h", state=True)
        if c.cuda:
            for s in slots:
                s.record_stream(c.stream)
        c.join()
        clock.wait(saved[-1], "moments_out_wait_s", host=False)  # the moments are home before the next step
