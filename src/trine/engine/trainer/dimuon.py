"""Dimuon: Tinker's second optimizer, for the matrices of a LoRA adapter.

Tinker documents it by its settings (`DimuonParams`): a momentum EMA (`beta1`), a row and column
preconditioner smoothed by `damping`, a matrix-sign step whose iteration count and normalisation
epsilon are internal, a learning rate "applied to a direction with Frobenius norm sqrt(rank)" and a
learning-rate correction relative to rank 32. The update of one matrix P (gradient G, LoRA rank r):

    M  <- beta1 * M + (1 - beta1) * G                      momentum (state, saved in checkpoints)
    X  =  M / rms(M)                                        scale-free: damping means the same at any scale
    X  <- diag(mean_j X_ij^2 + damping)^(-1/4) X diag(mean_i X_ij^2 + damping)^(-1/4)
                                                            rows and columns balanced (diagonal Shampoo)
    O  =  msign(X)                                          Newton-Schulz, NS_STEPS quintic iterations
    P  <- P - learning_rate * (r / 32) ** exponent * sqrt(r) * O / ||O||_F

Gradients are clipped first to a global norm when grad_clip_norm > 0. A matrix whose momentum is
zero (LoRA's A before B has moved) does not move. This is trine's reading of the documented
definition: Tinker does not publish its constants, so trajectories match Tinker's in kind, not bit
for bit.

Invariants
- Every step's direction has Frobenius norm sqrt(rank) exactly (zero momentum: no step).
- The state is a `momentum` tensor (the shape of its parameter) and a `step` count per parameter,
  under torch.optim's `state` so checkpoint.py saves and restores it like AdamW's.
"""

from __future__ import annotations

import math

import torch

from ..api import DimuonConfig

NS_STEPS = 5
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic: pushes singular values towards 1 fast
NORM_EPS = 1e-7
RANK_REFERENCE = 32


def matrix_sign(x: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The orthogonal polar factor of a 2-D `x` (U V^T of its SVD), approximately, by Newton-Schulz."""
    a, b, c = NS_COEFFS
    wide = x.shape[0] <= x.shape[1]
    y = x if wide else x.T  # iterate on the small Gram matrix
    y = y / (y.norm() + NORM_EPS)  # singular values <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y if wide else y.T


def balanced(m: torch.Tensor, damping: float) -> torch.Tensor:
    """`m` scaled to RMS 1, its rows and columns divided by the fourth root of their damped mean
    squares (a diagonal two-sided preconditioner)."""
    x = m / (m.pow(2).mean().sqrt() + NORM_EPS)
    sq = x.pow(2)
    rows = (sq.mean(dim=1, keepdim=True) + damping).pow(-0.25)
    cols = (sq.mean(dim=0, keepdim=True) + damping).pow(-0.25)
    return rows * x * cols


class Dimuon(torch.optim.Optimizer):
    """Dimuon over the matrices of one LoRA adapter of rank `rank`. Settings come with each step
    (`step(config)`), as Tinker sends them with each optim_step."""

    def __init__(self, params, rank: int):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        super().__init__(params, {})

    def init_state(self, p: torch.Tensor) -> dict:
        return {"step": torch.zeros(()), "momentum": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, config: DimuonConfig | None = None) -> None:  # type: ignore[override]
        if config is None:
            raise ValueError("Dimuon.step needs its DimuonConfig")
        scale = config.learning_rate * (self.rank / RANK_REFERENCE) ** config.rank_lr_correction_exponent
        target = math.sqrt(self.rank)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.init_state(p))
                state["step"] += 1
                m = state["momentum"]
                m.mul_(config.beta1).add_(p.grad, alpha=1 - config.beta1)
                if not bool(m.abs().max() > 0):
                    continue
                m2 = m.reshape(m.shape[0], -1).float()
                o = matrix_sign(balanced(m2, config.damping))
                o = o * (target / (o.norm() + NORM_EPS))
                p.add_(o.reshape(p.shape).to(p.dtype), alpha=-scale)
