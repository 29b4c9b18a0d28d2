# %% [markdown]
# # Your experiment: from "I have a model" to a measured multi-rank run
#
# **The question.** You have a PyTorch model. What does it cost to train it on several ranks — where does the
# time go on each rank, which bytes cross the wire, which tensors hold the memory? This notebook is a template:
# replace the model cell with yours, keep the rest, and you get a real run on `world_size` processes (gloo on
# this CPU, nccl on GPUs), a Gantt chart of every rank and a memory plot by category.
#
# ```
#  this notebook                      every rank (a process of its own)
#  ─────────────                      ─────────────────────────────────
#  class MyModel ...      ─┐
#  def experiment(ctx, cfg) ├─ launch ─► experiment(ctx, cfg): build the model, wrap it in DDP, train,
#                          ─┘            record spans (ctx.timeline), bytes (ctx.ledger),
#                                        memory (MemoryTracker)
#  results[rank]  ◄───────────────────── return a dict of plain numbers
#  figures and checks
# ```
#
# The model and the function are defined in cells below; `launch` sends their source to the ranks (with the
# imports and constants they use), so nothing has to be saved to a file first.

# %% tags=["parameters"]
import os

world_size: int = 2
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "none"  # emulated cluster under the run: none | h100-ib400 | a100-ib200 | pcie-100gbe
timeout_s: float = 300

# %%
import hashlib

import torch
import torch.nn as nn
from IPython.display import Markdown, display
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from toolkit import MemoryTracker, launch, viz

SIZES = {"smoke": {"d": 64, "layers": 2, "batch": 8, "steps": 3},
         "default": {"d": 256, "layers": 4, "batch": 16, "steps": 8},
         "full": {"d": 1024, "layers": 8, "batch": 32, "steps": 50}}
cfg = SIZES[preset]


# %% [markdown]
# ## 1 · Your model
#
# Any `nn.Module` works; this one is a stack of MLP blocks. The class is defined here, in the notebook: it
# travels to the ranks with the function that uses it.

# %%
class MyModel(nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                      for _ in range(layers)])

    def forward(self, x):  # [batch, d] -> [batch, d]
        return x + self.blocks(x)


# %% [markdown]
# ## 2 · What every rank runs
#
# Data parallelism: every rank builds the same model (same seed), trains on its own data, and DDP averages the
# gradients. Three measuring tools, all already installed on every rank:
# - `ctx.timeline.span(...)` records when each phase ran, on clocks aligned across ranks (the Gantt chart);
# - `ctx.ledger` counts every `torch.distributed` call and its bytes on the wire (DDP's all-reduce goes through
#   `torch.distributed` once `allreduce_hook` is registered: the same collective, now visible);
# - `MemoryTracker` counts live tensor bytes by category (parameters, gradients, optimizer state, activations).

# %%
def experiment(ctx, cfg):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MyModel(cfg["d"], cfg["layers"]).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own data
    losses = []
    with MemoryTracker(model, opt) as mem:
        for step in range(cfg["steps"]):
            x = torch.randn(cfg["batch"], cfg["d"], generator=gen).to(ctx.device)
            with ctx.ledger.tag("train"):
                with ctx.timeline.span("forward", step=step):
                    loss = ddp(x).pow(2).mean()
                mem.mark(f"forward {step}")
                with ctx.timeline.span("backward", step=step):  # DDP's all-reduces run inside, per bucket
                    loss.backward()
                mem.mark(f"backward {step}")
                with ctx.timeline.span("optimizer", step=step):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                mem.mark(f"optimizer {step}")
            losses.append(ctx.mean_over_ranks(loss.detach()))
            ctx.progress(step + 1, cfg["steps"], "training")
    weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return {"params": weights.numel(), "losses": losses, "spans": ctx.timeline.to_json(),
            "memory": mem.samples, "peak": mem.peak,
            "allreduce_bytes": ctx.ledger.total("sent_bytes", tag="train", op="all_reduce"),
            "allreduce_seconds": ctx.ledger.total("seconds", tag="train", op="all_reduce"),
            "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()}


# %% [markdown]
# ## 3 · The run

# %%
results = launch(experiment, world_size, cfg, backend=backend, timeout_s=timeout_s, cluster=cluster)
r0 = results[0]

# %% [markdown]
# ## 4 · Where the time goes, rank by rank
#
# One bar per span; the all-reduces hide inside `backward` (DDP starts each bucket's all-reduce as soon as its
# gradients are ready). Hover for the step number.

# %%
spans = [s for r in results for s in r["spans"]]
viz.gantt(spans, label="step", title=f"{world_size} ranks, {cfg['steps']} steps of DDP training").show()
comm_share = r0["allreduce_seconds"] / sum(s["end"] - s["start"] for s in r0["spans"] if s["kind"] == "backward")
display(Markdown(f"On rank 0 the all-reduce calls took **{r0['allreduce_seconds'] * 1e3:.1f} ms**, "
                 f"{100 * comm_share:.0f} % of the backward spans (measured on this machine, this run)."))

# %% [markdown]
# ## 5 · Memory by category on rank 0
#
# Parameters and optimizer state stay; gradients appear in the backward; activations come and go with each
# forward and backward.

# %%
viz.memory_over_time(r0["memory"], title="rank 0: live tensor bytes by category").show()
display(Markdown(f"Peak on rank 0: **{viz.human_bytes(r0['peak']['total'])}** "
                 f"({', '.join(f'{k} {viz.human_bytes(v)}' for k, v in r0['peak'].items() if k != 'total' and v)})."))

# %% [markdown]
# ## 6 · Checks
#
# Data parallelism keeps every replica identical (same weights, bit for bit, after every step); each step's
# all-reduce moves the ring's 2(n−1)/n of the gradient bytes per rank; the parameters are what the model says.

# %%
n, psi, steps = world_size, r0["params"], cfg["steps"]
assert len({r["weights_sha256"] for r in results}) == 1, "the replicas diverged"
assert all(r["allreduce_bytes"] == steps * 2 * (n - 1) * 4 * psi // n for r in results)
assert r0["peak"]["param"] == 4 * psi
assert all(len(r["losses"]) == steps for r in results)

# %%
# NBVAL_CHECK_OUTPUT
print(f"parameters: {psi}")
print(f"all-reduce bytes per step and rank: {r0['allreduce_bytes'] // steps} = 2(n-1)/n * 4 * {psi}")
print(f"parameter bytes on each rank: {r0['peak']['param']}")
print(f"replicas identical: {len({r['weights_sha256'] for r in results}) == 1}")

# %% [markdown]
# ## 7 · Something to try
#
# - **Your model** (a code edit of section 2): replace `MyModel` and the loss in `experiment`; keep the spans, the
#   ledger tag and the marks.
# - **ZeRO-3** instead of DDP (a code edit of `experiment`): `zdp = toolkit.ZeroDataParallel(model, stage=3)`, then
#   `zdp(x)...backward()`, `zdp.step()`: the ledger shows the all-gathers and reduce-scatters, the memory plot the
#   shards.
# - **A pipeline** (a code edit of `experiment`): `stages = toolkit.pipeline_stages(list_of_layers, toolkit.make_schedule("1f1b", world_size, m),
#   ctx.rank)` and `toolkit.PipelineExecutor(schedule, ctx.rank, stages, loss_fn, act_shape,
#   timeline=ctx.timeline).step(inputs, targets)`: the Gantt chart then shows F and B of every micro-batch
#   (`examples/pipeline_dualpipev.py` does it with DualPipeV and checks the gradients against one process).
# - **Compressed gradients** (a code edit of `experiment`): `ddp.register_comm_hook(toolkit.EDGCHook(toolkit.EDGCConfig(warmup=5)),
#   toolkit.EDGCHook.hook)` and compare `allreduce_bytes` (`examples/edgc_ddp.py`).
# - `toolkit.doc("name")` prints any public name's shapes, what runs on every rank and an example.
#
# ## Primary sources
# - PyTorch DDP: S. Li et al., *PyTorch Distributed: Experiences on Accelerating Data Parallel Training*,
#   VLDB 2020 (gradient buckets overlapped with the backward).
# - Ring all-reduce bytes: P. Patarasuk and X. Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
#   workstations*, JPDC 2009.
