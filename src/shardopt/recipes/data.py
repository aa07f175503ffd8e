"""Synthetic language-modelling data, generated from ``(seed, global sample index)``.

Sequences follow a fixed random sparse Markov chain over the vocabulary: each token has a few possible
successors with random probabilities, all derived from the seed. A model learns it visibly (the loss
falls from ``ln(vocab_size)`` towards the chain's entropy rate, :meth:`MarkovTask.entropy_rate`), and
nothing is downloaded or read from disk.

Sample ``i`` depends only on ``(seed, i)``. A step consumes ``global_batch_size`` consecutive samples;
DP rank ``r`` of ``dp_size`` takes the ``r``-th equal slice of them. The data position is therefore one
integer, the next global sample index, and resuming from it gives the same global batches at any DP
size that divides the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over the generator seed space
# Added to every branch's (squared, so skewed) random weight: no transition is so rare that a
# short run never sees it.
_BRANCH_WEIGHT_FLOOR = 0.05


class MarkovTask:
    """A random sparse Markov chain with ``branching`` successors per token."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, branching: int = 4) -> None:
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"need vocab_size >= 2 and seq_len >= 1, got {vocab_size}, {seq_len}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        branching = min(branching, vocab_size)
        gen = torch.Generator().manual_seed(seed)
        # Sparse rows (successor ids + CDF) so a 50k vocabulary costs 50k * branching entries, not 50k^2.
        # A repeated successor id just merges two branches' probabilities.
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=gen)
        weights = torch.rand(vocab_size, branching, generator=gen, dtype=torch.float64) ** 2
        weights += _BRANCH_WEIGHT_FLOOR
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        self.cdf = self.probs.cumsum(dim=1)
        self.cdf[:, -1] = 1.0

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * _MIX + index) % 2**63)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1`` as a ``[count, seq_len + 1]`` int64 tensor."""
        if start < 0 or count < 0:
            raise ValueError(f"sample range must be non-negative, got start={start}, count={count}")
        firsts, uniforms = [], []
        for index in range(start, start + count):
            gen = self._generator(index)
            firsts.append(torch.randint(self.vocab_size, (1,), generator=gen))
            uniforms.append(torch.rand(self.seq_len, generator=gen, dtype=torch.float64))
        out = torch.empty(count, self.seq_len + 1, dtype=torch.int64)
        if count == 0:
            return out
        out[:, 0] = torch.cat(firsts)
        u = torch.stack(uniforms, dim=1).unsqueeze(2)  # [seq_len, count, 1]
        for t in range(self.seq_len):
            cur = out[:, t]
            choice = torch.searchsorted(self.cdf[cur], u[t]).clamp_(max=self.cdf.shape[1] - 1)
            out[:, t + 1] = self.successors[cur].gather(1, choice).squeeze(1)
        return out

    def entropy_rate(self) -> float:
        """Mean entropy in nats of a token's successor distribution: the loss a perfect model reaches.

        Averaged uniformly over tokens, which matches a long sequence only approximately (the first
        token is uniform, later ones follow the stationary distribution).
        """
        # Branches that share a successor id are one outcome: merge them before taking the entropy.
        keys = (torch.arange(self.vocab_size).unsqueeze(1) * self.vocab_size + self.successors).flatten()
        unique, inverse = torch.unique(keys, return_inverse=True)
        merged = torch.zeros(unique.numel(), dtype=torch.float64).scatter_add_(0, inverse, self.probs.flatten())
        return float(-(merged * merged.log()).sum() / self.vocab_size)


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How one step's global batch is split over DP ranks and micro-batches."""

    global_batch_size: int
    """Samples per optimizer step, over all ranks."""
    dp_size: int
    dp_rank: int
    micro_batch_size: int
    """Samples per forward/backward on one rank."""

    def __post_init__(self) -> None:
        if self.global_batch_size % self.dp_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by the DP size {self.dp_size}"
            )
        if self.local_batch_size % self.micro_batch_size:
            raise ValueError(
                f"per-rank batch {self.local_batch_size} (global {self.global_batch_size} / "
                f"{self.dp_size} ranks) is not divisible by the micro-batch size {self.micro_batch_size}"
            )

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        return self.local_batch_size // self.micro_batch_size

    def local_range(self, step_start: int) -> tuple[int, int]:
        """This rank's ``(first sample index, count)`` of the step whose batch starts at ``step_start``."""
        return step_start + self.dp_rank * self.local_batch_size, self.local_batch_size


def local_batches(
    task: MarkovTask, plan: BatchPlan, step_start: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step as ``(inputs, targets)`` pairs, each ``[micro, seq_len]``."""
    first, count = plan.local_range(step_start)
    seqs = task.samples(first, count)
    return [
        (chunk[:, :-1], chunk[:, 1:]) for chunk in seqs.split(plan.micro_batch_size)
    ]
