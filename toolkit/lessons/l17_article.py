"""The article's 13B case study (§6.3) at its true shapes, before and after its ZeRO step (a model: nothing runs).

The article tunes a 13B model on 24 A100s from 1.8 s to 1.12 s a step in five steps. One of them is a change of
sharding the emulated cluster can time from the program: "ZeRO-2 → ZeRO-3 + NVMe offload", 1.38 s → 1.25 s.
Both sides are the project's GPT at LLaMA-13B's widths, built with fake tensors and timed on one fake rank of 24
(``toolkit.models.real_runs``, the machinery checked against published runs)::

    before  ZeRO-2 (DeepSpeed's, bf16)   forward, backward; each gradient reduce-scattered as it is ready;
                                         AdamW on the fp32 master 1/24; all-gather of the bf16 weights
    after   ZeRO-3 (FSDP2, bf16)         every layer's weights gathered before it runs (prefetched), its
            + optimizer on NVMe          gradients reduce-scattered behind the backward; then the host's step:
                                         the fp32 states read from NVMe, Adam on the CPU, written back

The host's step is ``planner.offload_terms``' model (PCIe, host Adam, NVMe read and write). DeepSpeed's
swapper pipelines them over sub-groups, so the step is at least the longest term and at most their sum: the
interval judged spans the two and the sensitivity band (compute x0.7-1.3, links x0.8-1.2; the disk is kept).

What the article leaves open, assumed here (``case_13b``'s, plus):
- tokens per GPU per step: ``ARTICLE_TOKENS_PER_GPU``;
- gradients reduced in bf16 on both sides (DeepSpeed's default for a bf16 model);
- the optimizer's states alone on NVMe (the article offloads the parameters too: more traffic, not less).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from toolkit.lessons.l17_capstone import case_13b
from toolkit.models.real_runs import Run, time_run
from toolkit.planner import offload_terms
from toolkit.runtime.bench import Claim
from toolkit.runtime.emulator_report import over_band

ARTICLE_STEPS = (("start: PyTorch DDP + ZeRO-2", 1.8), ("NCCL settings + custom_topo.xml", 1.52),
                 ("torch.compile(mode='reduce-overhead')", 1.38), ("ZeRO-2 → ZeRO-3 + NVMe offload", 1.25),
                 ("DataLoader num_workers=16, pin_memory", 1.18), ("layered AMP (embedding bf16, body fp16)", 1.12))
"""The article's §6.3 tuning, step by step: what changed and the step time after it, in seconds."""
ARTICLE_TOKENS_PER_S = 620
"""Throughput the article gives at its start (§6.3, "吞吐620 tokens/sec")."""
ZERO3_CLAIM = Claim.ratio("ZeRO-2 → ZeRO-3 + NVMe offload: step time", 1.25 / 1.38, source="the “distributed "
                          "optimization in practice” article §6.3", setting="13B on 24 A100s")
"""The article's step 3 as a claim: 1.38 s → 1.25 s, a 0.906× step."""
ARTICLE_TOKENS_PER_GPU = 1024
"""Tokens per GPU per step: a sequence of 1,024, the power of two nearest the 1,116 that the article's 620 tokens/s
and 1.8 s give (read per GPU: read for all 24 GPUs it is 46 tokens each, no sequence a 13B model trains at)."""


def article_runs(hw, tokens_per_gpu: int | None = None) -> dict[str, Run]:
    """The two shardings of the article's 13B at LLaMA-13B's widths (40 layers, hidden 5120, 40 heads, vocabulary
    32,000) on 24 GPUs of ``hw``, one sequence of ``tokens_per_gpu`` per GPU (default ``ARTICLE_TOKENS_PER_GPU``)."""
    seq = tokens_per_gpu or ARTICLE_TOKENS_PER_GPU
    before = Run("the article", "13B", "A100", 24, seq, 1, 40, 5120, 40, 32000, "zero2", hw,
                 "LLaMA-13B's widths; the article's §6.3", accumulation_steps=1)
    return {"before": before,
            "after": replace(before, sharding="fsdp", reduce_dtype=torch.bfloat16, device_optimizer=False)}


def zero3_step(hw=None, tokens_per_gpu: int | None = None, host: dict | None = None) -> dict:
    """The article's step 3 at the true shapes: each side's traced step (``Estimate``), the host's optimizer
    (``host``: ``planner.offload_terms`` on ``hw`` with ``pipelined``, their longest, and ``serial``, their sum,
    unless given), the ratio after / before with the host
    pipelined (``ratio``) and its interval over pipelined-to-serial and the sensitivity band (``low``, ``high``),
    and the start's step beside the article's 1.8 s. ``hw``: ``case_13b``'s cluster with 8 GPUs a node."""
    w, article_hw, gpus, assume = case_13b()
    hw = hw or replace(article_hw, ranks_per_node=8)
    runs = article_runs(hw, tokens_per_gpu)
    est = {k: time_run(r) for k, r in runs.items()}
    if host is None:
        terms = offload_terms(w, gpus, 1, 1, 3, "nvme", hw, assume)
        host = {**terms, "pipelined": max(terms.values()), "serial": sum(terms.values())}

    def ratios(c) -> tuple[float, float]:
        before, after = est["before"].on(c).step_s, est["after"].on(c).step_s
        return (after + host["pipelined"]) / before, (after + host["serial"]) / before

    sens = over_band(ratios, hw)
    points = [sens["value"], *sens["band"].values()]
    tokens = runs["before"].seq_len
    return {"cluster": hw.name, "tokens_per_gpu": tokens, "estimates": est, "host": host,
            "before_s": est["before"].step_s, "after_device_s": est["after"].step_s,
            "after_s": est["after"].step_s + host["pipelined"], "ratio": points[0][0],
            "low": min(p[0] for p in points), "high": max(p[1] for p in points),
            "before_tokens_per_s": tokens / est["before"].step_s,
            "article_start_s": ARTICLE_STEPS[0][1], "start_ratio": ARTICLE_STEPS[0][1] / est["before"].step_s,
            "exposed_comm_s": est["before"].exposed_s, "peak_gb": {k: e.peak_bytes / 1e9 for k, e in est.items()}}
