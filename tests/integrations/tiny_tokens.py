"""Random token sequences for the Hugging Face Trainer tests (in-process and the DDP script):
``n`` sequences of ``seq`` ids below ``vocab``, drawn from ``seed``, each its own label (a causal
language model's batch)."""

from __future__ import annotations

import torch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, vocab: int, seq: int) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}
