"""What one ATen op costs on the target GPU: the kernel it stands for (kind, FLOPs, bytes, shape).

The emulated cluster (``toolkit.runtime.emulator``) sees every ATen op a rank runs; this module turns one into a
``toolkit.runtime.efficiency.Kernel``, which the GPU's efficiency model then times:

- FLOPs as ``torch.utils.flop_counter`` counts them (matmuls and attention), and QR and SVD by Golub & Van Loan's
  counts (``qr_flops``, ``svd_flops``: flop_counter has none); other ops 0 (their bytes time them).
- Bytes: the op's tensor inputs plus outputs (the ``out=`` buffers only written; a gather reads a few rows of
  its table: indices + 2 x output). Float tensors count ``float_bytes`` per element (bf16 on the GPU, whatever
  the CPU run holds, usually fp32).
- Kind and shape: ``mm``/``addmm``/``bmm``/``baddbmm`` are GEMMs with their (M, N, K, batch); the flash-attention
  kernels are attention with (batch·heads, sequence, head size, causal, backward), their FLOPs halved when
  causal (the masked half is skipped, as FlashAttention's kernels and throughput figures count it); a
  factorisation is GEMM-like without a shape (the GEMM plateau: optimistic for cuSOLVER); everything else is
  memory-bound.
- Views and empty allocations launch no kernel (``launches_kernel``); ``.item()``-like ops make the host wait
  (``HOST_SYNC``).
"""
from __future__ import annotations

import math

import torch

from .efficiency import Kernel

# ---- which ATen ops are kernels, and what they cost ------------------------------------------------------------
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.")
# not views by their schema, but they launch no kernel either (a new header, or memory from the allocator)
NO_KERNEL = {"aten._unsafe_view", "aten._reshape_alias", "aten.lift_fresh", "aten.empty", "aten.empty_like",
             "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.set_"}
# ops that make the host wait for the device (the value goes to Python); toolkit.to_host: ``host_read``
HOST_SYNC = {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal", "toolkit.to_host"}
# ops that read a few rows of a large input: bytes = indices + 2 x output, not the whole table
GATHER_LIKE = {"aten.embedding", "aten.index_select", "aten.gather", "aten.index"}


@torch.library.custom_op("toolkit::to_host", mutates_args=())
def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True)


def host_read(t: torch.Tensor) -> list:
    """``t.tolist()`` through one op, ``toolkit.to_host``: the copy to the host's memory that ``.tolist()`` of a
    device tensor makes, after which the host holds the values (it waited for the device). The emulated cluster's
    clock and ``toolkit.graphs.audit`` see it as a host sync; a plain ``.tolist()`` of a CPU tensor dispatches no op,
    so on this machine neither would see that the host needs the value (DeepEP's normal mode sizing its receive
    buffers from the exchanged counts, for one)."""
    return _to_host(t.detach()).tolist()


def launches_kernel(func) -> bool:
    """Whether an ATen op (an ``OpOverload``) computes: not a view (``func.is_view``: ``view``, ``t``,
    ``transpose``, ``expand``, ``detach``, ...) and not in ``NO_KERNEL``. On a GPU such an op is about one
    kernel launch (some launch none or several: ``cudaLaunchKernel`` from the profiler is the real count)."""
    return not func.is_view and str(func.overloadpacket) not in NO_KERNEL


def _sdpa_cpu_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _sdpa_cpu_backward_flops(grad_out, q, k, v, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


def _batch_l_k(a: torch.Tensor) -> tuple[int, int, int]:
    """(matrices in the batch, longer side l, shorter side k) of a [..., m, n] input."""
    m, n = a.shape[-2], a.shape[-1]
    return math.prod(a.shape[:-2]), max(m, n), min(m, n)


def qr_flops(a: torch.Tensor, mode: str = "reduced", *args, out_val=None, **kwargs) -> int:
    """Householder QR of [..., m, n] (LAPACK geqrf): 2lk² − 2k³/3 per matrix, l = max(m, n), k = min(m, n); forming
    Q (orgqr, modes "reduced" and "complete") as much again (Golub & Van Loan, Matrix Computations, 4th ed., 5.2)."""
    batch, l, k = _batch_l_k(a)
    factor = 2 * l * k * k - 2 * k ** 3 / 3
    return int(batch * factor * (1 if mode == "r" else 2))


def svd_flops(a: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True, *args, out_val=None,
              **kwargs) -> int:
    """SVD of [..., m, n] by Golub–Kahan–Reinsch, per matrix (Golub & Van Loan, 4th ed., Fig. 8.6.1): the values only
    4lk² − 4k³/3; with thin U and V 14lk² + 8k³; with full U and V 4l²k + 8lk² + 9k³."""
    batch, l, k = _batch_l_k(a)
    if not compute_uv:
        per = 4 * l * k * k - 4 * k ** 3 / 3
    elif full_matrices:
        per = 4 * l * l * k + 8 * l * k * k + 9 * k ** 3
    else:
        per = 14 * l * k * k + 8 * k ** 3
    return int(batch * per)


def _flop_formulas() -> dict:
    """flop_counter's registry (matmuls, convolutions, attention), plus the CPU flash-attention kernels it does not
    list (same formulas) and the factorisations a compressor runs (QR, SVD: flop_counter counts them as 0)."""
    from torch.utils.flop_counter import flop_registry
    table = dict(flop_registry)
    aten = torch.ops.aten
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flops),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flops),
                          ("linalg_qr", qr_flops), ("_linalg_svd", svd_flops)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = formula
    return table


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def element_bytes(dtype: torch.dtype, float_bytes: int) -> int:
    """Bytes per element on the target: floats of 16 to 32 bits as ``float_bytes`` (bf16: 2), others as they are
    (``float_bytes`` 0: every tensor at its own dtype's size, as a program at the real dtypes runs)."""
    if float_bytes and dtype.is_floating_point and 2 <= dtype.itemsize <= 4:
        return float_bytes
    return dtype.itemsize


def _bytes(tensors, float_bytes: int) -> int:
    return sum(t.numel() * element_bytes(t.dtype, float_bytes) for t in tensors)


GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu": False,
             "aten._scaled_dot_product_flash_attention_for_cpu_backward": True}
"""The flash-attention kernels SDPA runs on a CPU (the emulated run's), and whether each is a backward; their
``is_causal`` is argument 4 (forward) or 7 (backward)."""


def _signature(x):
    """A hashable stand-in for a formula's arguments: tensors by shape (a FLOP formula reads nothing else)."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x)


def _gemm_dims(name: str, args) -> tuple:
    """(M, N, K, batch) of a GEMM op's operands."""
    a, b = (args[1], args[2]) if name in ("aten.addmm", "aten.baddbmm") else (args[0], args[1])
    if a.dim() == 3:
        return (a.shape[1], b.shape[2], a.shape[2], a.shape[0])
    return (a.shape[0], b.shape[1], a.shape[1], 1)


def _attention_dims(backward: bool, args, kwargs) -> tuple:
    """(batch·heads, sequence, head size, causal, backward) of a flash-attention op."""
    q = args[1] if backward else args[0]
    causal_at = 7 if backward else 4
    causal = bool(kwargs.get("is_causal", args[causal_at] if len(args) > causal_at else False))
    return (math.prod(q.shape[:-2]), q.shape[-2], q.shape[-1], causal, backward)


class OpKind:
    """What one ATen overload is, worked out once per overload (the dispatch mode sees thousands of calls a step):
    its name, whether it launches a kernel worth timing, and how its ``Kernel`` is made. FLOPs are cached by
    argument shapes (a formula runs torch's pytree over its arguments: as slow as the op itself here)."""

    __slots__ = ("name", "timed", "host_sync", "formula", "written", "gather_like", "flops_by_shape", "kind",
                 "backward")

    def __init__(self, func, formulas: dict):
        self.name = str(func.overloadpacket)
        self.timed = launches_kernel(func) and not self.name.startswith(COLLECTIVE_NAMESPACES)
        self.host_sync = self.name in HOST_SYNC
        self.formula = formulas.get(func.overloadpacket)
        self.written = frozenset(a.name for a in func._schema.arguments if a.is_out)  # out=, or Q=/R= of qr.out
        self.gather_like = self.name in GATHER_LIKE
        self.flops_by_shape: dict = {}
        self.kind = "gemm" if self.name in GEMMS or self.name in ("aten.linalg_qr", "aten._linalg_svd") else \
            "attention" if self.name in ATTENTION else "memory"
        self.backward = ATTENTION.get(self.name, False)

    def flops(self, args, kwargs, out) -> float:
        if self.formula is None:
            return 0.0
        key = (_signature(args), _signature(kwargs))
        flops = self.flops_by_shape.get(key)
        if flops is None:
            flops = self.flops_by_shape[key] = float(self.formula(*args, **kwargs, out_val=out))
        return flops

    def kernel(self, args, kwargs, out, float_bytes: int) -> Kernel:
        """The kernel this call stands for on the target (module docstring)."""
        read = _tensors((args, {k: v for k, v in kwargs.items() if k not in self.written} if self.written else kwargs))
        if self.gather_like:
            index = [t for t in read if not t.dtype.is_floating_point]
            nbytes = _bytes(index, float_bytes) + 2 * _bytes(_tensors(out), float_bytes)
        else:
            nbytes = _bytes(read, float_bytes) + _bytes(_tensors(out), float_bytes)
        flops = self.flops(args, kwargs, out)
        dims: tuple = ()
        if self.kind == "gemm" and self.name in GEMMS:
            dims = _gemm_dims(self.name, args)
        elif self.kind == "attention":
            dims = _attention_dims(self.backward, args, kwargs)
            flops *= 0.5 if dims[3] else 1.0
        return Kernel(self.kind if flops > 0 else "memory", flops, float(nbytes), dims)
