"""How far another GEMM kernel's result may lie from F.linear's in the same dtype: the bound the
GEMM candidates' self-checks use (packed.py's `agrees_with_linear`, gemm_choice.py's measurement).

Invariants
- fp32: two kernels each sum the k-term dot products (the bias one more term) in an order of
  their own, each within gamma_k sum|x||w| of the exact value (Higham, Thm. 3.1), so within twice
  that of each other.
- bf16: the inputs are the same bf16 values in both; each product of two bf16 values is exact in
  fp32 (8 + 8 significant bits), each kernel accumulates in fp32 (the same gamma_k sum|x||w|) and
  rounds the result to bf16 once (unit roundoff u = 2^-8). With E the exact value, A and B the two
  fp32 sums, a = bf16(A) and b = bf16(B) (b is F.linear's, `want`): |a - b| <= u|A| + 2 gamma S +
  u|B|, |B| <= |b| / (1 - u) and |A| <= |B| + 2 gamma S, so
  |a - b| <= 2 (u |b| + gamma S) (1 + 2u) / (1 - u), S = sum|x||w| (+ |bias|). A kernel that
  rounds the product to bf16 before adding the bias rounds once more, by at most u (1 + gamma)
  sum|x||w|: with a bias, twice that is added.
- Every bound is computed in fp32 from the inputs' values (exact in fp32 for bf16 inputs).
"""

from __future__ import annotations

import torch


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative bound of a k-term dot product's rounding in
    `dtype` (u its unit roundoff)."""
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def linear_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, want: torch.Tensor
) -> torch.Tensor:
    """Elementwise bound (fp32) on |y - want| for another kernel's y = F.linear(x, weight, bias),
    `want` F.linear's own result, all in x's dtype (fp32 or bf16: the module docstring)."""
    xw = x.float().abs() @ weight.float().abs().t()
    k, s = x.shape[-1], xw
    if bias is not None:
        k, s = k + 1, xw + bias.float().abs()
    g = gamma(k)
    if x.dtype == torch.float32:
        return 2 * g * s
    u = torch.finfo(x.dtype).eps / 2
    bound = 2 * (u * want.float().abs() + g * s) * ((1 + 2 * u) / (1 - u))
    return bound if bias is None else bound + 2 * u * (1 + g) * xw
