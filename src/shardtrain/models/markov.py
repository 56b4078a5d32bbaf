"""Training data the project makes itself (nothing is downloaded).

:class:`MarkovCorpus` samples token streams from a fixed sparse Markov chain: each token has a few likely
successors. A model that learns the chain drives the loss from ``ln(vocab)`` down towards the chain's
entropy, so the demo's loss curve visibly drops within a few dozen steps.
"""

from __future__ import annotations

import math

import torch


class MarkovCorpus:
    def __init__(self, vocab_size: int, successors: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        # each token may be followed by `successors` tokens with skewed probabilities
        self.next_tokens = torch.randint(0, vocab_size, (vocab_size, successors), generator=g)
        weights = torch.rand(vocab_size, successors, generator=g) ** 3 + 0.05
        self.next_probs = weights / weights.sum(dim=1, keepdim=True)

    def entropy(self) -> float:
        """Per-token entropy of the chain in nats (the loss a perfect model approaches)."""
        p = self.next_probs
        return float(-(p * p.log()).sum(dim=1).mean())

    @staticmethod
    def uniform_loss(vocab_size: int) -> float:
        return math.log(vocab_size)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[batch_size, seq_len]`` int64; targets are inputs shifted by one."""
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        for t in range(seq_len):
            choice = torch.multinomial(self.next_probs[tokens[:, t]], 1, generator=generator).squeeze(1)
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], choice]
        return tokens[:, :-1], tokens[:, 1:]
