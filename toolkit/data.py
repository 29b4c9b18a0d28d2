"""Real tokens without a download: Python's own standard library, byte-tokenized.

``data/pycode.bin`` holds ~2 MB of stdlib source (documents separated by byte 0);
``data/doc_lengths.json`` the lengths of every stdlib module (a real long-tailed
document-length distribution). ``data/build_corpus.py`` rebuilds both.

The tokenizer is the identity on bytes: vocabulary 256, id 0 = end of document.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
VOCAB_SIZE = 256
EOD = 0


def encode(text: str) -> torch.Tensor:
    """Text -> byte token ids [N] (int64)."""
    return torch.tensor(list(text.encode("utf-8", "replace")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return bytes(int(i) for i in ids.tolist()).decode("utf-8", "replace")


@lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """All tokens of ``data/pycode.bin`` as an int64 tensor [N]."""
    raw = (DATA_DIR / "pycode.bin").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def doc_lengths() -> list[int]:
    """Token lengths of the stdlib modules (for sequence packing and context-parallel lessons)."""
    return json.loads((DATA_DIR / "doc_lengths.json").read_text())["lengths"]


def batches(batch_size: int, seq_len: int, steps: int, seed: int = 0, rank: int = 0, world: int = 1,
            vocab_size: int = VOCAB_SIZE, device: torch.device | str | None = None):
    """Yield ``steps`` (inputs, targets) pairs, each [batch_size, seq_len], for one data-parallel rank.

    Windows are drawn at random (seeded) from the corpus; the global batch of a step is
    ``world * batch_size`` windows and rank ``rank`` gets its slice, so any dp size sees
    the same global data. Tokens are folded into ``vocab_size`` when it is below 256. ``device``: where
    the batches go (they are built on the CPU).
    """
    if batch_size < 1 or seq_len < 1 or steps < 0:
        raise ValueError(f"batch_size, seq_len must be >= 1 and steps >= 0; got {batch_size}, {seq_len}, {steps}")
    tokens = corpus()
    if vocab_size < VOCAB_SIZE:
        tokens = tokens % vocab_size
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (world * batch_size,), generator=gen)
        mine = starts[rank * batch_size:(rank + 1) * batch_size]
        window = torch.stack([tokens[s:s + seq_len + 1] for s in mine.tolist()])
        x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()
        yield (x, y) if device is None else (x.to(device), y.to(device))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batch_size: int, n_batches: int, seed: int = 12345) -> float:
    """Mean loss of a ``toolkit.models.GPT`` on ``n_batches`` fixed batches (the same on every rank and run)."""
    device = next(model.parameters()).device
    data = batches(batch_size, model.cfg.seq_len, n_batches, seed=seed, device=device)
    return sum(model(x, y).item() for x, y in data) / n_batches
