"""The real models the course's toys stand for: their true shapes, one definition each, and the kernels of a layer.

Every cost model of the toolkit (the planner, the emulated cluster's workload-matched mode, the vocabulary- and
context-parallel simulators) reads its model from here, so a 13B layer is the same 13B layer everywhere::

    ModelSpec "llama2-13b"   layers 40 · hidden 5120 · heads 40 (kv 40) · SwiGLU ffn 13824 · vocab 32000
      one layer, forward, T tokens (bf16):   qkv  [T, d] @ [d, d + 2·d_kv]        attention  causal, s² pairs
                                             proj [T, d] @ [d, d]                 MLP  gate+up [T, d] @ [d, 2f]
                                                                                       down    [T, f] @ [f, d]
      backward: each GEMM twice (dX and dW, the same FLOPs), flash attention 2.5x its forward

FLOPs per token follow the usual accounting (Narayanan et al. 2021, PaLM's appendix B): 6 · N_active for the
weights (forward 2, backward 4) plus attention, 12 · layers · seq · hidden without the causal halving (what
public MFU figures such as torchtitan's and Megatron-LM's count); ``causal=True`` halves the attention term
(what flash attention computes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.runtime.efficiency import Kernel, attention, gemm, kernel_seconds, memory


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shapes (no biases; RMSNorm/LayerNorm weights left out of the counts)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    ffn: int
    """The MLP's inner width; an MoE's: each routed expert's."""
    vocab: int
    seq_len: int = 4096
    """The training sequence length of the model's source."""
    gated: bool = True
    """SwiGLU (gate, up, down: three matrices) or a plain two-matrix MLP (GELU)."""
    experts: int = 0
    """Routed experts per MoE layer (0: a dense MLP)."""
    top_k: int = 0
    """Routed experts per token."""
    shared_experts: int = 0
    """Experts every token goes through, beside the routed ones."""
    tied_embeddings: bool = False
    """Input embedding and output head share one table."""
    source: str = ""

    # ---- shapes ---------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def moe(self) -> bool:
        return self.experts > 0

    # ---- parameters -------------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        """q and o (d x d each), k and v (d x d_kv each)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    def expert_params(self) -> int:
        """One MLP (or one expert): ``mlp_matrices`` matrices of d x ffn."""
        return self.mlp_matrices * self.hidden * self.ffn

    def layer_params(self) -> int:
        """One layer, every expert counted (and the router)."""
        experts = self.experts + self.shared_experts if self.moe else 1
        router = self.hidden * self.experts if self.moe else 0
        return self.attention_params() + experts * self.expert_params() + router

    def active_layer_params(self) -> int:
        """One layer as one token sees it: the attention and the experts it is routed to."""
        experts = self.top_k + self.shared_experts if self.moe else 1
        return self.attention_params() + experts * self.expert_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()

    def active_params(self) -> int:
        return self.layers * self.active_layer_params() + self.embedding_params()

    # ---- FLOPs ------------------------------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int | None = None, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward): 6 · active parameters + 12 · layers · seq · hidden for
        attention (``causal``: half of it)."""
        s = seq_len or self.seq_len
        attention = 12.0 * self.layers * s * self.hidden * (0.5 if causal else 1.0)
        return 6.0 * self.active_params() + attention

    def layer_gemm_flops(self, tokens: int, tp: int = 1) -> float:
        """Forward FLOPs of one layer's GEMMs on ``tokens`` tokens, one rank of a ``tp``-way tensor-parallel group
        (the attention scores are not GEMMs of weights: ``attention_flops``)."""
        return 2.0 * tokens * self.active_layer_params() / tp

    def attention_flops(self, batch: int, seq_len: int, causal: bool = True, tp: int = 1) -> float:
        """Forward FLOPs of one layer's attention scores and values (QKᵀ and PV) for ``batch`` sequences."""
        return 4.0 * batch * seq_len * seq_len * self.hidden * (0.5 if causal else 1.0) / tp


def _check(spec: ModelSpec) -> ModelSpec:
    for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"ModelSpec {name} must be an int >= 1, got {v!r}")
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"ModelSpec {spec.name}: heads={spec.heads} must divide hidden={spec.hidden}, and "
                         f"kv_heads={spec.kv_heads} must divide heads")
    if spec.experts and not 1 <= spec.top_k <= spec.experts:
        raise ValueError(f"ModelSpec {spec.name}: top_k={spec.top_k} must be in 1..experts={spec.experts}")
    return spec


_LLAMA2 = "Touvron et al. 2023, Llama 2, Table 1, and the released configs (config.json)"
MODELS: dict[str, ModelSpec] = {m.name: _check(m) for m in (
    ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, source=_LLAMA2),
    ModelSpec("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, source=_LLAMA2),
    ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, source=_LLAMA2),
    ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192,
              source="Llama 3 model card and released config.json (Meta, 2024)"),
    ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192,
              source="Llama 3 model card and released config.json (Meta, 2024)"),
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, experts=8, top_k=2,
              source="Jiang et al. 2024, Mixtral of Experts, Table 1, and the released config.json"),
    ModelSpec("deepseek-v3", 61, 7168, 128, 128, 2048, 129280, 4096, experts=256, top_k=8, shared_experts=1,
              source="DeepSeek-V3 technical report §4.2 and the released config.json: 256 routed SwiGLU experts of "
                     "width 2048, top-8, one shared expert; its multi-head latent attention and its 3 dense first "
                     "layers are counted as plain attention and MoE layers here"),
    ModelSpec("gpt-18b", 40, 6144, 48, 48, 4 * 6144, 51200, 2048, gated=False, tied_embeddings=True,
              source="Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters, Table 1 "
                     "(the 18.4B GPT: hidden 6144, 40 layers, 48 heads)"),
    ModelSpec("gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 51200, 2048, gated=False, tied_embeddings=True,
              source="Brown et al. 2020, GPT-3, Table 2.1 (the model of Megatron-LM's published scaling runs)"),
)}
"""The named models (``get(name)``). Llama 2 70B's parameter count from these shapes is 69.0B, 13B's 13.0B, 7B's
6.74B, Mixtral's 46.7B (the sources' figures)."""


def gpt(name: str, layers: int, hidden: int, vocab: int, seq_len: int, ffn: int | None = None,
        heads: int | None = None) -> ModelSpec:
    """A GPT of the toy's kind (a plain GELU MLP of 4·hidden, no GQA, untied embeddings) of the given size: the
    lessons' own models, and papers' that name only these sizes (heads: one per 64 of hidden unless given)."""
    heads = heads or max(1, hidden // 64)
    return _check(ModelSpec(name, layers, hidden, heads, heads, ffn or 4 * hidden, vocab, seq_len, gated=False))


def get(name: str | ModelSpec, **replace) -> ModelSpec:
    """A model by name (``MODELS``), or a ``ModelSpec`` as is, with fields replaced (``seq_len=2048``); checked.
    An unknown name lists the known ones."""
    if isinstance(name, ModelSpec):
        spec = name
    elif name in MODELS:
        spec = MODELS[name]
    else:
        raise ValueError(f"model {name!r} is not in the catalog; known: {sorted(MODELS)}")
    return _check(dataclasses.replace(spec, **replace)) if replace else spec


@dataclass
class Workload:
    """A model and the batch it trains on: what the planner places and the cost models time."""
    model: ModelSpec | str = "llama2-7b"
    """The model: a name from ``MODELS`` or a ``ModelSpec``."""
    seq_len: int | None = None
    """Tokens per sequence (None: the model's training length)."""
    micro_batch: int = 1
    global_batch: int = 512
    """Sequences per optimizer step (= dp · micro_batch · micro-batches)."""
    recompute: bool = False
    """Full activation recomputation."""
    params: float | None = None
    """Ψ, total parameters (None: the model's; set it to place a model known by its size alone)."""

    def __post_init__(self):
        self.model = get(self.model)
        self.seq_len = self.seq_len or self.model.seq_len
        self.params = float(self.params if self.params is not None else self.model.params())

    @property
    def layers(self) -> int:
        return self.model.layers

    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def heads(self) -> int:
        return self.model.heads

    @property
    def ffn_hidden(self) -> int:
        return self.model.ffn

    @property
    def experts(self) -> int:
        return self.model.experts

    @property
    def top_k(self) -> int:
        return self.model.top_k


# ---- the kernels of a layer: what the cost models time ----------------------------------------------------------
def layer_kernels(spec: ModelSpec, batch: int, seq_len: int, tp: int = 1, backward: bool = False,
                  elem: int = 2, causal: bool = True) -> list[Kernel]:
    """One dense layer (or one MoE layer with its tokens balanced over its experts, ``top_k`` each) on one rank of
    a ``tp``-way tensor-parallel group, forward or backward, for ``batch`` sequences of ``seq_len``: the GEMMs at
    their shapes, flash attention, and the elementwise passes (norms, residuals, activation, rotary)."""
    T, d, f = max(1, round(batch * seq_len)), spec.hidden, spec.ffn
    heads = spec.heads // tp
    qkv = (d + 2 * spec.kv_dim) // tp
    gemms = [(T, qkv, d), (T, d, d // tp)]
    routed = (spec.top_k + spec.shared_experts) if spec.moe else 1
    up = (spec.mlp_matrices - 1) * f // tp
    for _ in range(routed):  # each routed token slot: its expert's GEMMs (balanced: T rows per slot)
        gemms += [(T, up, d), (T, d, f // tp)]
    out = []
    for m, n, k in gemms:
        if backward:  # dX = dY @ Wᵀ and dW = Xᵀ @ dY
            out += [gemm(m, k, n, elem), gemm(k, n, m, elem)]
        else:
            out.append(gemm(m, n, k, elem))
    out.append(attention(max(1, round(batch * heads)), seq_len, spec.head_dim, causal, backward, elem))
    grad = 2 if backward else 1  # a backward pass reads the forward's tensors and the incoming gradients
    # two norms (read, write), two residual adds (2 reads, 1 write), rotary on q and k (read, write)
    out.append(memory(grad * 14 * T * d * elem, count=8))
    # the activation of each routed slot: gate and up read, the product written (SwiGLU); GELU: read, write
    out.append(memory(grad * spec.mlp_matrices * T * f // tp * routed * elem, count=routed))
    return out


def head_kernels(spec: ModelSpec, tokens: int, tp: int = 1, backward: bool = False, elem: int = 2) -> list[Kernel]:
    """The output layer on ``tokens`` tokens (its vocabulary split over ``tp``): the logits GEMM (backward: dX and
    dW) and the softmax's passes over the logits (fp32)."""
    v = spec.vocab // tp
    if backward:
        return [gemm(tokens, spec.hidden, v, elem), gemm(spec.hidden, v, tokens, elem), memory(3 * tokens * v * 4)]
    return [gemm(tokens, v, spec.hidden, elem), memory(4 * tokens * v * 4)]


def kernels_seconds(kernels: list[Kernel], gpu) -> float:
    """Seconds of ``kernels`` back to back on ``gpu`` (a ``toolkit.runtime.cluster.GPU``): each at its achieved
    rate (``toolkit.runtime.efficiency``), host costs hidden behind them (they run ahead)."""
    return sum(kernel_seconds(k, gpu.bf16_flops, gpu.hbm_bytes_per_s, gpu.sms, gpu.efficiency) for k in kernels)


def train_seconds(spec: ModelSpec, gpu, batch: int, seq_len: int, tp: int = 1, pp: int = 1,
                  recompute: bool = False) -> dict[str, float]:
    """One GPU's kernel seconds for the forward and backward of ``batch`` sequences of ``seq_len`` through its
    share of the model (``layers / pp`` layers at ``tp``-way tensor parallelism, the output layer's 1/pp):
    ``forward``, ``backward`` (with the forward again under full ``recompute``), ``total``, and ``mfu``: the
    model's FLOPs for those tokens (``flops_per_token``, the usual accounting) over the time at the dense peak."""
    per = spec.layers / pp
    tokens = max(1, round(batch * seq_len))
    fwd = per * kernels_seconds(layer_kernels(spec, batch, seq_len, tp), gpu) \
        + kernels_seconds(head_kernels(spec, tokens, tp), gpu) / pp
    bwd = per * kernels_seconds(layer_kernels(spec, batch, seq_len, tp, backward=True), gpu) \
        + kernels_seconds(head_kernels(spec, tokens, tp, backward=True), gpu) / pp
    total = fwd + bwd + (fwd if recompute else 0.0)
    flops = spec.flops_per_token(seq_len) * tokens / (tp * pp)
    return {"forward": fwd, "backward": bwd + (fwd if recompute else 0.0), "total": total,
            "mfu": flops / (total * gpu.bf16_flops)}
