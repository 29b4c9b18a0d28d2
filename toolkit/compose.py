"""Compose the techniques: one typed config, one fixed order, each piece through its own toolkit API.

A tiny MoE GPT trained on ``pp × dp`` ranks, the experts of every MoE layer spread over the ``dp`` replicas
of its pipeline rank (expert parallelism inside data parallelism). ``ComposeConfig`` says which technique is
on; ``Composed`` builds one rank's share, always in this order, because each piece needs what the one
before it made::

    1 model       GPT(preset, n_expert), weights from the seed; bf16 compute weights      toolkit.models
                  when precision is bf16 (the master copy is the optimizer's business, step 5);
                  their GEMMs in fp32, rounded once, where the CPU's bf16 GEMMs are slow  toolkit.runtime.bf16
    2 experts     expert_parallel(model, ep group, codec)                                   toolkit.moe
                  every MoE layer now dispatches its tokens to the expert's rank (all-to-all)
                  a2a_codec="int8": tokens travel as int8 + scales (bf16 combine)
    3 pipeline    make_schedule(1f1b | dualpipev) + split_stages + PipelineExecutor       toolkit.pipeline
                  this rank keeps only its stages; p2p inside the pp group
                  vocab_parallel: vocab_1f1b + VocabStage + the VocabPasses hook (the output layer and
                  the embedding split over every pipeline rank)
                  moe_overlap (DualPipeV): the EPOverlap hook runs every F&B pair with one half's expert
                  all-to-alls under the other half's compute (toolkit.pipeline.ep_overlap)
    4 DP comm     the replicated gradients of each stage averaged over dp                 toolkit.comm
                  dp_comm="allreduce": PowerSGDReducer at rank None (one flat all-reduce per stage)
                  dp_comm="edgc": EDGC, low rank per stage from the gradient's entropy
                  expert gradients are divided by dp instead (they already hold every replica's tokens)
    5 optimizer   precision="fp32": torch AdamW;  "bf16": MasterAdamW (bf16 weights, fp32 master);
                  "bf16_residual": ReuseAdamW (bf16 weights + int16 residual = the fp32 master)  toolkit.memory
    6 memory      offload != "none": the Offload hook, ActivationOffloader around every      toolkit.memory
                  forward/backward of the executor (the rank's action order comes from the schedule)
                  The executor's hooks are a list in this order: [VocabPasses, Offload], or [EPOverlap] alone.

    Composed.step(inputs, targets):
        zero grads ─► pipeline step (F, B, W; p2p; EP all-to-alls) ─► experts / dp ─► DP comm ─► optimizer
        returns the loss of the global batch (mean over the dp replicas), on every rank

Conflicts are raised by ``ComposeConfig.validate`` before any process starts, each naming both sides and
why (``CONFLICTS``), e.g. vocabulary parallelism runs its S/T passes inside a 1F1B order (``vocab_1f1b``), so
it cannot be combined with DualPipeV. ``chain(base, names)`` turns techniques on one at a time and validates
every prefix, so a chain that reaches a conflict fails at the step that causes it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.runtime.bf16 import bf16_as_storage

PRECISIONS = ("fp32", "bf16", "bf16_residual")
A2A_CODECS = ("none", "bf16", "int8", "int4", "fp8")
DP_COMMS = ("allreduce", "edgc", "sdp4bit")
ORDER = ("model", "experts", "pipeline", "dp_comm", "optimizer", "memory")
"""The order ``Composed`` applies the pieces in."""


@dataclass
class ComposeConfig:
    """Which techniques are on, and the sizes of the run (torchtitan style: one documented field each)."""

    # ---- 1 model ----------------------------------------------------------------------------------------
    model: str = "smoke"
    """``toolkit.models`` size preset (``smoke``, ``default``, ``full``)."""
    n_layer: int = 4
    """Transformer blocks (divisible by the number of pipeline stages)."""
    n_expert: int = 4
    """Experts per MoE layer; 0 makes the model dense (no expert options then)."""
    top_k: int = 2
    """Experts each token is routed to."""
    seed: int = 0
    """Seed of the weights (the data has its own)."""
    # ---- parallel layout -----------------------------------------------------------------------------------
    pp: int = 2
    """Pipeline ranks."""
    dp: int = 2
    """Data-parallel replicas of each pipeline rank (world size = pp × dp)."""
    ep: int = 2
    """Expert-parallel size inside dp: 1 (every replica holds every expert) or dp (experts spread)."""
    # ---- 2 experts -----------------------------------------------------------------------------------------
    a2a_codec: str = "none"
    """How tokens travel to their experts: none (as they are), bf16, int8, int4 or fp8 (+ fp32 scales)."""
    a2a_block: int = 32
    """Channels per fp32 scale of a quantized all-to-all (must divide the model's d_model)."""
    moe_overlap: bool = False
    """Overlap the expert all-to-alls of each DualPipeV F&B pair with the other half's compute (forward under
    backward, ``toolkit.pipeline.ep_overlap.EPOverlap``); needs schedule="dualpipev" and ep > 1."""
    # ---- 3 pipeline ----------------------------------------------------------------------------------------
    schedule: str = "1f1b"
    """Pipeline schedule: a registered name (``toolkit.pipeline.SCHEDULES``), e.g. ``1f1b`` (pp stages) or
    ``dualpipev`` (2·pp stages in a V, F&B pairs); the schedule says what layouts it runs (``pipeline.needs``)."""
    m: int = 4
    """Micro-batches per step."""
    micro_batch: int = 2
    """Sequences per micro-batch."""
    vocab_parallel: bool = False
    """Split the embedding and the output layer over every pipeline rank (needs 1F1B)."""
    # ---- 4 DP communication --------------------------------------------------------------------------------
    dp_comm: str = "allreduce"
    """How replicated gradients are averaged over dp: ``allreduce`` or ``edgc`` (``sdp4bit`` is rejected here)."""
    edgc_warmup: int = 0
    """EDGC: plain all-reduce steps before compression starts (the rank is then decided every step; 0: the first
    step is compressed at ``edgc_rank``)."""
    edgc_rank: int = 4
    """EDGC: rank at the end of the warm-up (r_init; the entropy moves it within [1, 4 × r_init])."""
    # ---- 5 optimizer ---------------------------------------------------------------------------------------
    precision: str = "fp32"
    """``fp32`` (fp32 weights, torch AdamW), ``bf16`` (bf16 weights, fp32 master: MasterAdamW) or
    ``bf16_residual`` (bf16 weights, master = weight + int16 residual: ReuseAdamW)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    # ---- 6 memory ------------------------------------------------------------------------------------------
    offload: str = "none"
    """Activation offload policy of ``toolkit.memory.offload`` (``none``, ``all``, ``attention``, ``mlp``, ...)."""
    offload_skip_within: int = 1
    """Pipeline-aware offload: keep a micro-batch on the device when its backward comes within this many of the
    rank's actions after its forward (``long_lived``; 0 offloads every micro-batch)."""

    # -------------------------------------------------------------------------------------------------------
    def replace(self, **changes) -> "ComposeConfig":
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"ComposeConfig has no field {unknown}; fields: {[f.name for f in fields(self)]}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def n_stages(self) -> int:
        from toolkit.pipeline import needs
        return needs(self.schedule).stages(self.pp)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    def model_config(self):
        from toolkit.models import preset
        return preset(self.model, n_layer=self.n_layer, n_expert=self.n_expert, top_k=self.top_k)

    def validate(self, world_size: int | None = None) -> "ComposeConfig":
        """ValueError naming the field (or the two techniques in conflict) and what is allowed."""
        from toolkit.memory.offload import resolve_policy
        from toolkit.models.gpt import PRESETS
        from toolkit.pipeline import SCHEDULES  # every registered schedule (toolkit.pipeline.register)
        for name, choices in (("model", tuple(PRESETS)), ("schedule", tuple(SCHEDULES)), ("precision", PRECISIONS),
                              ("a2a_codec", A2A_CODECS), ("dp_comm", DP_COMMS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; allowed: {list(choices)}")
        for name in ("n_layer", "pp", "dp", "ep", "m", "micro_batch", "top_k", "edgc_rank", "a2a_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("n_expert", "seed", "edgc_warmup", "offload_skip_within"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        resolve_policy(self.offload)
        if not isinstance(self.moe_overlap, bool):
            raise ValueError(f"moe_overlap must be True or False, got {self.moe_overlap!r}")
        if world_size is not None and world_size != self.pp * self.dp:
            raise ValueError(f"world_size={world_size} is not pp × dp = {self.pp} × {self.dp} = {self.pp * self.dp}; "
                             f"pick pp and dp whose product is the world size")
        # ---- the model against the layout: the schedule says what it needs
        from toolkit.pipeline import check_layout
        check_layout(self.schedule, self.pp, self.m, self.n_layer)
        # ---- MoE options need experts
        if self.n_expert == 0:
            used = [f"{k}={v!r}" for k, v, off in (("ep", self.ep, 1), ("a2a_codec", self.a2a_codec, "none"))
                    if v != off]
            if used:
                raise ValueError(f"MoE options on a dense model: {', '.join(used)} need n_expert > 0 "
                                 f"(n_expert=0 has no experts to dispatch to)")
        else:
            if not 1 <= self.top_k <= self.n_expert:
                raise ValueError(f"top_k={self.top_k} must be in 1..n_expert={self.n_expert}")
            if self.ep not in (1, self.dp):
                raise ValueError(f"ep={self.ep} must be 1 or dp={self.dp}: the experts are spread over the whole dp "
                                 f"group (a partial ep group would need a second gradient group)")
            if self.n_expert % self.ep:
                raise ValueError(f"n_expert={self.n_expert} must be divisible by ep={self.ep} (each rank owns "
                                 f"n_expert/ep experts)")
            if self.ep == 1 and self.a2a_codec != "none":
                raise ValueError(f"a2a_codec={self.a2a_codec!r} needs ep > 1: with ep=1 every expert is local and no "
                                 f"token travels")
            d_model = self.model_config().d_model
            if self.a2a_codec in ("int8", "int4", "fp8") and (self.a2a_block % 2 or d_model % self.a2a_block):
                raise ValueError(f"a2a_block={self.a2a_block} must be even and divide d_model={d_model} (one fp32 "
                                 f"scale per token per block of channels)")
        for check in CONFLICTS:
            check(self)
        return self


# ---- conflicts: each names both techniques and the reason -------------------------------------------------------
def _vocab_needs_1f1b(c: ComposeConfig) -> None:
    if c.vocab_parallel and c.schedule != "1f1b":
        raise ValueError(f"conflict: vocab_parallel=True with schedule={c.schedule!r}. Vocabulary parallelism "
                         "weaves its S/T passes into a 1F1B order (toolkit.pipeline.vocab_parallel.vocab_1f1b, one "
                         "stage per rank); DualPipeV holds two stages per rank in a V. Use schedule='1f1b'.")


def _sdp4bit(c: ComposeConfig) -> None:
    if c.dp_comm == "sdp4bit":
        why = []
        if c.pp > 1:
            why.append(f"its topology spans the whole world (make_topology has no dp subgroup), here pp={c.pp}")
        if c.precision != "fp32":
            why.append(f"ShardedDP owns the optimizer (fp32 master shards), so precision={c.precision!r} "
                       "has no optimizer to run")
        if c.n_expert and c.ep > 1:
            why.append("it averages every parameter over all ranks, but expert parameters differ per rank")
        raise ValueError("conflict: dp_comm='sdp4bit' cannot be composed: " + ("; ".join(why) or
                         "ShardedDP replaces the model's parameters and the optimizer") + ". Use dp_comm='edgc' "
                         "(it averages the gradients in place and leaves the optimizer to step 5).")


def _moe_overlap(c: ComposeConfig) -> None:
    if not c.moe_overlap:
        return
    if c.schedule != "dualpipev":
        raise ValueError(f"conflict: moe_overlap=True with schedule={c.schedule!r}. The expert all-to-alls are "
                         "overlapped inside DualPipeV's F&B pairs (the forward of one micro-batch under the backward "
                         "of another); 1F1B has no pairs. Use schedule='dualpipev'.")
    if not c.n_expert or c.ep < 2:
        raise ValueError(f"conflict: moe_overlap=True with n_expert={c.n_expert}, ep={c.ep}: there is no expert "
                         "all-to-all to overlap; it needs experts spread over ep > 1 ranks")
    if c.offload != "none":
        raise ValueError(f"conflict: moe_overlap=True with offload={c.offload!r}. EPOverlap runs each F&B pair "
                         "itself, interleaving its halves, so the offload hook, which copies around each single op, "
                         "cannot place its copies inside a pair. Use offload='none'.")


CONFLICTS = [_vocab_needs_1f1b, _sdp4bit, _moe_overlap]


# ---- techniques turned on one at a time ------------------------------------------------------------------------
TECHNIQUES: dict[str, dict] = {
    "dualpipev": {"schedule": "dualpipev"},
    "bf16": {"precision": "bf16"},
    "bf16_residual": {"precision": "bf16_residual"},
    "offload": {"offload": "all"},
    "vocab_parallel": {"vocab_parallel": True},
    "int8_a2a": {"a2a_codec": "int8"},
    "edgc": {"dp_comm": "edgc"},
    "ep_overlap": {"schedule": "dualpipev", "moe_overlap": True},
}
"""technique name -> the config fields it changes."""

LOSS_RTOL: dict[str, float] = {
    "dualpipev": 1e-5,        # the same math; micro-batch gradients summed in another order
    "bf16": 5e-3,             # bf16 weights and activations (8-bit mantissa) against fp32
    "bf16_residual": 0.0,     # bit-exact against bf16: MasterAdamW(rounding="away") is ReuseAdamW's reference
    "offload": 0.0,           # the bytes move, the values and the order of the ops do not
    "vocab_parallel": 1e-5,   # the sharded softmax sums in another order (in the activation dtype)
    "int8_a2a": 5e-3,         # tokens quantized to int8 per 32 channels on their way to the experts
    "edgc": 1e-2,             # low-rank gradients (with error feedback) change every update a little
    "ep_overlap": 1e-5,       # DualPipeV's reordering (against DualPipeV without the overlap: bit-exact)
}
"""How far each step's losses may move from the step before (relative), and why; the precision techniques'
depend on the step before: ``loss_rtol``."""


def loss_rtol(name: str, before: ComposeConfig) -> float:
    """The relative tolerance of turning ``name`` on after ``before``. ``bf16`` and ``bf16_residual`` both set
    ``precision``: from fp32 either one is a precision change (``LOSS_RTOL["bf16"]``); from the other bf16
    precision it is bit-exact (MasterAdamW(rounding="away") is ReuseAdamW's reference), so 0."""
    if name in ("bf16", "bf16_residual"):
        return LOSS_RTOL["bf16"] if before.precision == "fp32" else 0.0
    return LOSS_RTOL[name]


def chain(base: ComposeConfig, names: list[str], world_size: int | None = None) -> list[tuple[str, ComposeConfig]]:
    """``[("baseline", base), (names[0], base + names[0]), (names[1], base + names[0] + names[1]), ...]``, every
    prefix validated; a conflict raises naming the step that causes it."""
    out = [("baseline", base.validate(world_size))]
    cfg = base
    for i, name in enumerate(names):
        if name not in TECHNIQUES:
            raise ValueError(f"technique {name!r} is not known; allowed: {sorted(TECHNIQUES)}")
        if name in names[:i]:
            raise ValueError(f"technique {name!r} is turned on twice")
        cfg = cfg.replace(**TECHNIQUES[name])
        try:
            cfg.validate(world_size)
        except ValueError as err:
            raise ValueError(f"turning on {name!r} after {['baseline', *names[:i]]}: {err}") from None
        out.append((name, cfg))
    return out


# ---- one rank's share --------------------------------------------------------------------------------------------
@dataclass
class Composed:
    """One rank's share of the composed training run; build with ``Composed.build(cfg, grid, device)``."""

    cfg: ComposeConfig
    grid: object
    model: nn.Module
    modules: dict[int, nn.Module]
    schedule: object
    executor: object
    params: list[nn.Parameter]
    expert_params: list[nn.Parameter]
    reducer: object
    optimizer: torch.optim.Optimizer
    offloader: object = None
    ledger: object = None
    steps: int = 0
    history: list[dict] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: ComposeConfig, grid, device: torch.device | str = "cpu", ledger=None,
              timeline=None) -> "Composed":
        """Apply the pieces in ``ORDER`` on this rank (collective: every rank of the grid calls it)."""
        from toolkit.models import GPT
        cfg.validate(grid.sizes["pp"] * grid.sizes["dp"])
        if grid.sizes["pp"] != cfg.pp or grid.sizes["dp"] != cfg.dp:
            raise ValueError(f"the grid is pp={grid.sizes['pp']} x dp={grid.sizes['dp']}, the config "
                             f"pp={cfg.pp} x dp={cfg.dp}")
        device = torch.device(device)
        pp_rank = grid.rank_in("pp")
        # 1 model: the same weights on every rank (seeded), bf16 compute weights if asked
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model_config()).to(device)
        if cfg.dtype != torch.float32:
            model.to(cfg.dtype)
        # 2 experts: every MoE layer dispatches to the expert's rank of the ep group
        expert_ids: set[int] = set()
        if cfg.n_expert and cfg.ep > 1:
            from toolkit.moe import expert_parallel
            _, experts = expert_parallel(model, grid.group("ep"), codec=cfg.a2a_codec, block=cfg.a2a_block)
            expert_ids = {id(p) for p in experts}
        # 3 pipeline: the schedule, this rank's stages, the executor (with 6's hook when offloading)
        schedule, modules, executor, offloader = _pipeline(cfg, model, grid, pp_rank, device, timeline)
        params = [p for mod in modules.values() for p in mod.parameters()]
        params = list({id(p): p for p in params}.values())
        expert_params = [p for p in params if id(p) in expert_ids]
        replicated = [[p for p in modules[s].parameters() if id(p) not in expert_ids] for s in sorted(modules)]
        # 4 DP communication over the replicas of this pipeline rank: one bucket per stage
        reducer = _dp_comm(cfg, [b for b in replicated if b], grid.group("dp"))
        # 5 optimizer over everything this rank holds
        optimizer = _optimizer(cfg, params)
        return cls(cfg, grid, model, modules, schedule, executor, params, expert_params, reducer, optimizer,
                   offloader, ledger)

    # -- the step -----------------------------------------------------------------------------------------
    def _tag(self, name: str):
        return self.ledger.tag(name) if self.ledger is not None else contextlib.nullcontext()

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """One training step over this replica's m micro-batches; the global batch's loss on every rank."""
        for p in self.params:
            p.grad = None
        bf16_gemms = bf16_as_storage() if self.cfg.dtype == torch.bfloat16 else contextlib.nullcontext()
        with bf16_gemms:  # on a CPU whose bf16 GEMMs are slow: in fp32 from the bf16 tensors, rounded once
            loss = self.executor.step(inputs, targets)  # p2p and the experts' all-to-alls happen in here
        dp = self.grid.sizes["dp"]
        if self.expert_params and dp > 1:
            for p in self.expert_params:  # summed over every replica's tokens by the all-to-alls: make it a mean
                if p.grad is not None:
                    p.grad.div_(dp)
        if self.reducer is not None:
            if self.cfg.dp_comm == "edgc":  # EDGC: the rank of each stage from its gradients' entropy
                rec = self.reducer.sync(self.steps)
                self.history.append({"step": self.steps, "ranks": list(rec["ranks"])})
            else:  # PowerSGDReducer at rank None: one flat all-reduce per stage
                self.reducer.reduce_()
        self.optimizer.step()
        self.steps += 1
        return self.global_loss(loss)

    def global_loss(self, loss: float | None) -> float:
        """Mean over the dp replicas of the loss the last stage computed (all-reduced, tagged ``metrics``)."""
        t = torch.tensor([0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with self._tag("metrics"):
                dist.all_reduce(t)
        return float(t[0] / t[1])

    @contextlib.contextmanager
    def record_routing(self):
        """Inside the block, record what the router decided, per (stage, micro-batch) and MoE layer: yields a dict
        ``{(stage, mb): [(rows its experts receive, pairs sent to other ranks, rows received from other ranks),
        ...]}`` filled as the forwards run (a stage's forwards come in micro-batch order in every schedule here).
        The memory and bytes models of the run take it as an input (``toolkit.compose_bytes``)."""
        from toolkit.moe import ExpertParallelMoE
        rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

        def routed(m) -> tuple[int, int, int]:
            plan, me = m.last_plan, m.dispatcher.rank
            return (int(sum(plan.recv_counts)), int(sum(plan.in_splits) - plan.in_splits[me]),
                    int(sum(plan.out_splits) - plan.out_splits[me]))

        handles = []
        for s, module in self.modules.items():
            calls = [-1]
            handles.append(module.register_forward_pre_hook(lambda m, a, calls=calls: calls.__setitem__(0, calls[0] + 1)))
            for sub in module.modules():
                if isinstance(sub, ExpertParallelMoE):
                    handles.append(sub.register_forward_hook(
                        lambda m, a, o, s=s, calls=calls: rows.setdefault((s, calls[0]), []).append(routed(m))))
        try:
            yield rows
        finally:
            for h in handles:
                h.remove()

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def _pipeline(cfg: ComposeConfig, model: nn.Module, grid, pp_rank: int, device, timeline):
    """The schedule, this rank's stage modules, the executor with its hooks (vocabulary passes, then offload),
    and the offloader."""
    from toolkit.models import lm_loss, split_stages
    from toolkit.pipeline.executor import PipelineExecutor
    from toolkit.pipeline.schedule import make_schedule
    peers, group = grid.ranks("pp"), grid.group("pp")
    mcfg = model.cfg
    act_shape = (cfg.micro_batch, mcfg.seq_len, mcfg.d_model)
    hooks = []
    if cfg.moe_overlap:
        from toolkit.pipeline.ep_overlap import EPOverlap
        hooks.append(EPOverlap())
    if cfg.vocab_parallel:
        from toolkit.pipeline import vocab_passes as vx
        schedule = vocab_schedule(cfg)
        groups = None
        for members in pipeline_groups(grid):  # collective: every rank makes every pipeline's groups, in order
            made = vx.vocab_groups(members)
            if members == peers:
                groups = made
        stage = vx.VocabStage(model, pp_rank, cfg.pp)
        modules, loss_fn = {pp_rank: stage}, None  # the vocabulary passes compute the loss
        hooks.append(vx.VocabPasses(stage, groups))
    else:
        schedule = make_schedule(cfg.schedule, cfg.pp, cfg.m)
        stages = split_stages(model, schedule.n_stages)
        modules, loss_fn = {s: stages[s] for s in schedule.stages_of(pp_rank)}, lm_loss
    offloader = None
    if cfg.offload != "none":
        from toolkit.memory.offload import ActivationOffloader, Offload, long_lived, schedule_order
        order = schedule_order(schedule, pp_rank)
        offloader = ActivationOffloader(modules, order, policy=cfg.offload,
                                        groups=long_lived(order, cfg.offload_skip_within))
        hooks.append(Offload(offloader))
    executor = PipelineExecutor(schedule, pp_rank, modules, loss_fn, act_shape, dtype=cfg.dtype, device=device,
                                peers=peers, group=group, timeline=timeline, hooks=hooks)
    return schedule, modules, executor, offloader


def vocab_schedule(cfg: ComposeConfig):
    """vocab_1f1b with the S and T passes placed by the vocabulary cost model (``vocab_costs``): only their
    place in each rank's order depends on it (the same on every rank), never the values computed."""
    from toolkit.pipeline import vocab_costs as vc
    from toolkit.pipeline import vocab_parallel as vp
    mcfg = cfg.model_config()
    w = vc.Workload(vc.gpt("the capstone's GPT", cfg.n_layer, mcfg.d_model, mcfg.vocab_size, mcfg.seq_len,
                           ffn=mcfg.d_ff, heads=mcfg.n_head), micro_batch=cfg.micro_batch)
    hw = vc.from_rates("placement model", matmul_flops=1e11, mem_bw=1e10, op_overhead_s=0.0, link_bytes_per_s=1e9)
    costs = vc.stage_costs(w, cfg.pp, hw, "vocab", VOCAB_ALGORITHM, elem=4 if cfg.precision == "fp32" else 2)
    return vp.vocab_1f1b(cfg.pp, cfg.m, VOCAB_ALGORITHM, vp.StageCosts(costs))


VOCAB_ALGORITHM = 2
"""Vocabulary parallelism's Algorithm 2: dX right after the first barrier (one barrier per micro-batch)."""


def pipeline_groups(grid) -> list[list[int]]:
    """The global ranks of every pipeline (one per dp replica), in the grid's order (pp slowest: rank =
    pp_rank · dp + dp_rank when cp = tp = 1)."""
    pp, dp = grid.sizes["pp"], grid.sizes["dp"]
    return [[p * dp + d for p in range(pp)] for d in range(dp)]


def _dp_comm(cfg: ComposeConfig, buckets: list[list[nn.Parameter]], group):
    if cfg.dp == 1 or not buckets:
        return None
    if cfg.dp_comm == "edgc":
        from toolkit.comm.edgc import EDGC, EDGCConfig
        edgc = EDGCConfig(warmup=cfg.edgc_warmup, window=1, isr_every=1, r_init=cfg.edgc_rank, r_min=1,
                          r_max=4 * cfg.edgc_rank, seed=cfg.seed, epsilon=1e-8)  # a zero-gradient shard stays 0
        return EDGC(buckets, edgc, group)
    from toolkit.comm.edgc import PowerSGDReducer
    return PowerSGDReducer(buckets, None, group)


def _optimizer(cfg: ComposeConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.precision == "fp32":
        return torch.optim.AdamW(params, lr=cfg.lr, foreach=False)
    from toolkit.memory.param_reuse import MasterAdamW, ReuseAdamW
    if cfg.precision == "bf16":
        return MasterAdamW(params, lr=cfg.lr, rounding="away")  # ReuseAdamW's bit-exact reference
    return ReuseAdamW(params, lr=cfg.lr)


__all__ = ["ComposeConfig", "Composed", "TECHNIQUES", "LOSS_RTOL", "loss_rtol", "CONFLICTS", "ORDER", "chain", "pipeline_groups", "vocab_schedule"]
