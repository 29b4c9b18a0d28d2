"""Parameter copy reuse: keep the fp32 master weight as the bf16 compute weight plus a 16-bit residual.

Plain mixed precision keeps two copies of every weight: the bf16 one the model computes with
(2 B) and the fp32 master the optimizer updates (4 B). The bf16 copy is (almost) the top half of
the fp32 bits, so the master only needs its bottom half stored next to it: 6 B -> 4 B per weight.

::

    fp32 master, viewed as int32 i      j = i + 0x8000 (int add: exact, and undone by j - 0x8000)
    ┌──────── hi16 ───────┬──── lo16 ────┐     ┌──── j >> 16 ─────┬── j & 0xFFFF ──┐
    │ sign exp mantissa.. │ ..mantissa   │ ──► │ bf16 weight      │ residual (int16)│
    └─────────────────────┴──────────────┘     └──────────────────┴─────────────────┘
    +0x8000 carries into hi16 exactly when lo16 >= 0x8000: the bf16 half is the fp32 value rounded to
    nearest, ties away from zero (torch's cast rounds ties to even: they differ only on ties,
    lo16 == 0x8000 with an even hi16).

    optimizer step, per chunk:  master = merge(bf16, residual)      # exact fp32, transient
                                AdamW(master, grad.float(), m, v)   # torch's own AdamW math
                                bf16, residual = split(master)      # written back in place

- ``split`` / ``merge``: the bit method of MindSpeed ``--reuse-fp32-param``; TE's
  ``FusedAdam(store_param_remainders=True)`` stores ``lo16`` of ``i`` instead of ``lo16`` of ``j`` (they
  differ in bit 15) and does the same inside its kernel.
- ``ReuseAdamW``: an optimizer over bf16 tensors (model parameters, or one flat shard of them under a
  sharded optimizer) whose state is ``residual`` (int16) + ``exp_avg`` + ``exp_avg_sq`` (fp32): no
  fp32 master is ever stored. The residual lives in its own tensor (as in TE); MindSpeed instead
  keeps it interleaved in the fp32 buffer the bf16 parameter aliases.
- Byte order: on a little-endian host (x86, ARM) an int32 word is the int16 pair (lo16, hi16) in
  memory, so ``split`` is a de-interleave of ``j`` viewed as int16 and ``merge`` a re-interleave (fast:
  strided copies). On a big-endian host that alias is wrong and ``split``/``merge`` fall back to shifts
  and masks, which give the same bits on any byte order (both paths are tested).
- ``MasterAdamW``: the baseline, an fp32 master per parameter, cast back with torch's
  round-half-even (plain mixed precision) or with the same rounding as ``split`` (the reference
  against which ``ReuseAdamW`` is bit-exact).
- Checkpoints (``state_dict``) hold the reconstructed fp32 master, never the residual.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_functional

LITTLE_ENDIAN = sys.byteorder == "little"

HALF = 0x8000  # half a bf16 ulp, in the units of the fp32 low half
BF16_OVERFLOW = 3.39617752923046e38  # 0x7F7F8000: from here on (in magnitude) the bf16 half is inf


def _finite(t: torch.Tensor, bound: float = float("inf")) -> bool:
    """All values finite and of magnitude below ``bound`` (one min/max pass; NaN fails every comparison)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool((lo > -bound) & (hi < bound))


def split(master: torch.Tensor, check: bool = True,
          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest with ties away from zero, int16 residual). Exactly invertible.

    ``out=(bf16, residual)`` writes into existing contiguous tensors (the optimizer's parameter and state).
    Raises ValueError on non-finite input (inf/NaN bit patterns can carry into the sign bit).
    A finite value of magnitude >= 0x7F7F8000 (3.3962e38) rounds to a bf16 inf; it still merges back
    exactly, but a model cannot compute with it, so ``ReuseAdamW`` raises on it.
    """
    if master.dtype != torch.float32:
        raise ValueError(f"split needs a float32 tensor, got {master.dtype}")
    if check and not _finite(master):
        raise ValueError(f"split needs finite values; got {int((~torch.isfinite(master)).sum())} inf/NaN")
    j = master.reshape(-1).view(torch.int32).clone().add_(HALF)  # [N] int32, the only transient (4 B/element)
    if LITTLE_ENDIAN:  # each int32 word is the int16 pair (lo16, hi16) in memory: de-interleave (MindSpeed)
        pairs = j.view(torch.int16).view(-1, 2)  # [N, 2]
        hi, lo = pairs[:, 1], pairs[:, 0]
    else:  # shifts and masks: the same bits on any byte order, at the cost of two int32 -> int16 casts
        hi, lo = j.bitwise_right_shift(16).to(torch.int16), j.bitwise_and_(0xFFFF).to(torch.int16)
    if out is not None:
        out[0].view(torch.int16).view(-1).copy_(hi)
        out[1].view(-1).copy_(lo)
        return out
    return hi.contiguous().view(torch.bfloat16).view(master.shape), lo.contiguous().view(master.shape)


def merge(bf16: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 residual) -> the exact fp32 value ``split`` took them from."""
    hi, lo = bf16.reshape(-1).view(torch.int16), residual.reshape(-1)
    if LITTLE_ENDIAN:  # re-interleave the halves into int32 words
        j = torch.empty(hi.numel(), dtype=torch.int32, device=hi.device)  # [N]
        pairs = j.view(torch.int16).view(-1, 2)  # [N, 2]
        pairs[:, 1].copy_(hi)
        pairs[:, 0].copy_(lo)
    else:
        j = hi.to(torch.int32).bitwise_left_shift_(16).bitwise_or_(lo.to(torch.int32).bitwise_and_(0xFFFF))
    return j.sub_(HALF).view(torch.float32).view(bf16.shape)


def round_half_away(master: torch.Tensor) -> torch.Tensor:
    """The bf16 half of ``split``: fp32 -> bf16, ties away from zero (torch's ``.bfloat16()`` ties to even)."""
    return split(master)[0]


def count_ties(master: torch.Tensor) -> dict[str, int]:
    """How often rounding ``master`` to bf16 is a tie, and on how many elements ``split`` and RNE differ."""
    i = master.view(torch.int32)
    tie = (i & 0xFFFF) == HALF
    even = ((i >> 16) & 1) == 0
    return {"ties": int(tie.sum()), "rne_mismatches": int((tie & even).sum())}


def _check_bf16_params(params: list[torch.Tensor], who: str) -> None:
    for i, p in enumerate(params):
        if p.dtype != torch.bfloat16:
            raise ValueError(f"{who} needs bfloat16 parameters (the compute copy); parameter {i} is {p.dtype}. "
                             "Cast the model first: model.to(torch.bfloat16)")
        if not p.is_contiguous():
            raise ValueError(f"{who} needs contiguous parameters; parameter {i} with shape {tuple(p.shape)} is not")
        if not _finite(p):
            raise ValueError(f"{who}: parameter {i} holds inf/NaN values")


def _check_finite_grads(params: list[torch.Tensor], who: str) -> None:
    """Checked for every parameter before any is updated, so a bad step changes nothing."""
    for i, p in enumerate(params):
        if p.grad is not None and not _finite(p.grad):
            raise ValueError(f"{who}: gradient of parameter {i} holds inf/NaN values; step skipped, nothing updated")


class _BaseAdamW(torch.optim.Optimizer):
    """AdamW over bf16 tensors; subclasses decide how the fp32 master is kept."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        _check_bf16_params(self._params(), type(self).__name__)
        for p in self._params():
            self._init_state(p)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _init_state(self, p: torch.Tensor) -> None:
        self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                         "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}

    @staticmethod
    def _adamw(group: dict, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               step: torch.Tensor) -> None:
        """torch's single-tensor AdamW, the very code ``torch.optim.AdamW(foreach=False)`` runs."""
        beta1, beta2 = group["betas"]
        adamw_functional([master], [grad], [m], [v], [], [step], foreach=False, amsgrad=False, beta1=beta1,
                         beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def master_weights(self) -> list[torch.Tensor]:
        """The fp32 master of every parameter (a fresh tensor each)."""
        return [self.master(p) for p in self._params()]

    def state_dict(self) -> dict:
        """A checkpoint with the reconstructed fp32 master (``"master"``), never the residual."""
        sd = super().state_dict()
        params = self._params()
        sd["state"] = {k: {"step": s["step"].clone(), "exp_avg": s["exp_avg"].clone(),
                           "exp_avg_sq": s["exp_avg_sq"].clone(), "master": self.master(params[k])}
                       for k, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint written by ``state_dict`` of this class or of the other one (both hold fp32 masters)."""
        # torch's loader casts floating state to the parameter's dtype (bf16 here): set the state ourselves
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = self._params()
        for k, s in state_dict["state"].items():
            p = params[int(k)]
            self.state[p] = {"step": s["step"].clone().float(), "exp_avg": s["exp_avg"].float().clone(),
                             "exp_avg_sq": s["exp_avg_sq"].float().clone()}
            with torch.no_grad():
                self._set_master(p, s["master"].float().clone())

    def _set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        raise NotImplementedError


class ReuseAdamW(_BaseAdamW):
    """AdamW whose fp32 master is the bf16 parameter plus an int16 residual (2 B/param less than ``MasterAdamW``).

    ``params``: bf16, contiguous tensors — a model's parameters, or the flat bf16 shard a sharded
    optimizer owns (give it a ``.grad`` of the same shape and dtype before ``step``). The master starts
    equal to the bf16 value (residual = 0x8000, i.e. lo16 of the master = 0, as TE's zeroed remainders).
    ``chunk_numel`` bounds the transient fp32 master materialized during ``step`` (4 B x chunk).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, chunk_numel: int = 1 << 20):
        if chunk_numel < 64 or chunk_numel % 64:
            raise ValueError(f"chunk_numel must be a positive multiple of 64 (whole SIMD vectors), got {chunk_numel}")
        self.chunk_numel = chunk_numel
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _init_state(self, p: torch.Tensor) -> None:
        super()._init_state(p)
        self.state[p]["residual"] = split(p.float())[1]  # [N] int16, all 0x8000 (= -32768)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        return merge(p, self.state[p]["residual"])

    def _set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        hi, lo = split(master)
        p.copy_(hi)
        self.state[p]["residual"] = lo

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        _check_finite_grads(self._params(), "ReuseAdamW")
        overflow = []  # one flag per chunk, checked once per step: no device sync per chunk
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                flat = (p.view(-1), p.grad.reshape(-1), s["residual"].view(-1), s["exp_avg"].view(-1),
                        s["exp_avg_sq"].view(-1))
                for a in range(0, p.numel(), self.chunk_numel):
                    w, g, r, m, v = (t[a:a + self.chunk_numel] for t in flat)
                    master = merge(w, r)  # [chunk] fp32, exact
                    # each chunk starts from the same step count; the real counter moves once, below
                    self._adamw(group, master, g.float(), m, v, s["step"].clone())
                    lo, hi = torch.aminmax(master)  # NaN fails both comparisons
                    overflow.append(~((lo > -BF16_OVERFLOW) & (hi < BF16_OVERFLOW)))
                    split(master, check=False, out=(w, r))
                s["step"] += 1
        if overflow and bool(torch.stack(overflow).any()):
            raise ValueError("ReuseAdamW: an updated master weight is inf/NaN or rounds to a bf16 inf "
                             "(|w| >= 3.3962e38); the weights and optimizer state are no longer usable")
        return loss


class MasterAdamW(_BaseAdamW):
    """The baseline: a separate fp32 master per bf16 parameter (4 B/param more than the bf16 weight).

    ``rounding="nearest_even"`` is plain mixed precision (``master.bfloat16()``, what AMP and Megatron
    do); ``rounding="away"`` casts ties away from zero like ``split``, the reference ``ReuseAdamW``
    matches bit for bit.
    """

    ROUNDINGS = ("nearest_even", "away")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, rounding: str = "nearest_even"):
        if rounding not in self.ROUNDINGS:
            raise ValueError(f"rounding={rounding!r} is not known; allowed: {self.ROUNDINGS}")
        self.rounding = rounding
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _init_state(self, p: torch.Tensor) -> None:
        super()._init_state(p)
        self.state[p]["master"] = p.detach().float()  # [N] fp32

    def master(self, p: torch.Tensor) -> torch.Tensor:
        return self.state[p]["master"].clone()

    def _set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        self.state[p]["master"] = master
        p.copy_(self._cast(master))

    def _cast(self, master: torch.Tensor) -> torch.Tensor:
        return master.bfloat16() if self.rounding == "nearest_even" else round_half_away(master)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        _check_finite_grads(self._params(), "MasterAdamW")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                self._adamw(group, s["master"], p.grad.float(), s["exp_avg"], s["exp_avg_sq"], s["step"])
                p.copy_(self._cast(s["master"]))
        return loss


def flatten_params_(model: nn.Module, multiple_of: int = 1) -> torch.Tensor:
    """Make every parameter of ``model`` a view of one flat buffer (padded to ``multiple_of``); return it.

    A sharded (ZeRO-1) optimizer then owns ``flat.chunk(dp)[rank]`` on each data-parallel rank and
    all-gathers the updated shards back into ``flat``.
    """
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    flat = torch.zeros(-(-n // multiple_of) * multiple_of, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.detach().view(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def bytes_by_category(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Storage bytes of the model's parameters and of the optimizer's state, each storage counted once.

    ``param``: the storages behind the parameters; ``master``: fp32 master copies or residuals (the
    part parameter copy reuse changes); ``moments``: exp_avg + exp_avg_sq; ``step``: the step counters.
    """
    seen: set[int] = set()

    def nbytes(t: torch.Tensor) -> int:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    out = {"param": sum(nbytes(p) for p in model.parameters()), "master": 0, "moments": 0, "step": 0}
    for s in optimizer.state.values():
        out["master"] += sum(nbytes(s[k]) for k in ("master", "residual") if k in s)
        out["moments"] += nbytes(s["exp_avg"]) + nbytes(s["exp_avg_sq"])
        out["step"] += nbytes(s["step"])
    return out
