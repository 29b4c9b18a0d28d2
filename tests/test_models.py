"""The tiny GPT: presets, pipeline split, MoE variant, data."""
from __future__ import annotations

import pytest
import torch

from toolkit.data import batches, corpus, decode, doc_lengths, encode
from toolkit.models import GPT, GPTConfig, lm_loss, preset, split_stages


def test_presets_and_bad_config():
    assert preset("smoke").d_model == 32
    assert preset("default", n_layer=8).n_layer == 8
    with pytest.raises(ValueError, match="preset='huge' is not known"):
        preset("huge")
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="top_k=3 must be in 1..n_expert=2"):
        GPTConfig(n_expert=2, top_k=3)


@pytest.mark.parametrize("moe", [False, True])
def test_pipeline_stages_equal_full_model(moe):
    torch.manual_seed(0)
    cfg = preset("smoke", n_layer=4, n_expert=4 if moe else 0)
    model = GPT(cfg)
    x, y = next(batches(2, cfg.seq_len, 1))
    full = model(x, y)
    h = x
    for stage in split_stages(model, 4):
        h = stage(h)
    assert torch.equal(lm_loss(h, y), full)  # same ops in the same order: bitwise
    with pytest.raises(ValueError, match="n_stages=3 must be >= 1 and divide n_layer=4"):
        split_stages(model, 3)


def test_loss_starts_near_uniform_and_learns():
    torch.manual_seed(0)
    cfg = preset("smoke")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches(8, cfg.seq_len, 30, seed=1):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.3
    assert losses[-1] < losses[0] - 1.0


def test_corpus_is_real_code_with_long_tailed_documents():
    toks = corpus()
    assert toks.numel() > 1_000_000 and int(toks.max()) < 256
    assert "def " in decode(toks[:20000])
    assert decode(encode("héllo")) == "héllo"
    lengths = sorted(doc_lengths())
    median, top = lengths[len(lengths) // 2], lengths[-1]
    assert top > 20 * median  # long tail
    a = [x for x, _ in batches(2, 16, 3, seed=5, rank=1, world=2)]
    b = [x for x, _ in batches(4, 16, 3, seed=5)]
    assert all(torch.equal(ai, bi[2:]) for ai, bi in zip(a, b))  # a dp rank gets its slice of the global batch
