"""How the suite compares floats: every bound follows from the computation, none from one CPU.

Two fp32 paths that compute the same math in different orders (chunked or whole, shared prefix or
plain, packed GEMM or torch's) round differently, and by how much depends on the CPU's kernels: an
AVX-512 GEMM sums its dot products in another order than an AVX2 one. A tolerance read off one
machine fails on the next. So each comparison here is one of three kinds, and each test says which:

1. **Bit for bit** (`assert_bitwise`): where the contract is exact (`--batch-invariant` kernels,
   data that is only moved, copied or cached, a computation repeated in the same order).
2. **A priori, for one reduction** (`dot_bound`): a kernel that computes dot products of length K
   (a GEMM, an attention row, a norm) is within gamma_K * sum|a*b| of the exact value (Higham,
   *Accuracy and Stability of Numerical Algorithms*, Thm. 3.1: gamma_K = K*u / (1 - K*u), u the
   unit roundoff), in any summation order; two such kernels are within twice that of each other.
3. **Measured against fp64, for a whole model** (`Rounding`): a forward or a training step is many
   reductions deep, and an a priori bound through it is loose by orders of magnitude. Instead the
   same computation runs in fp64 (the engine runs any model dtype; fp64 rounding is 2^29 times
   smaller), and the fp32 reference path's distance from it *is* what fp32 rounding does to this
   computation on this CPU. Another fp32 order may land up to about as far on the other side, so
   a path under test must be within `MARGIN` times that distance of the fp64 result. The same pair
   of paths in fp64 must agree to `FP64_SAME_MATH` of the values' scale: the algorithm is exact
   there, and a wrong term (a missing position, a stale block) shows at 1e-3 or more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2u for fp32: 1.19e-7
EPS64 = torch.finfo(torch.float64).eps

# Two fp32 orders of one computation: each is e from the fp64 value, so they differ by up to 2e;
# the worst element of another order's error spreads about 2x around the reference's (measured:
# 1.1-5x per tensor, 1.0-1.5x of the computation's worst relative error), hence 4 on the worst.
MARGIN = 4.0
# The same math in fp64, two orders: measured 1e-14 of the scale for a training step's gradients
# (~100 eps64 through the model); 1e-10 leaves 1e4 of room and is 1e7 below a wrong term.
FP64_SAME_MATH = 1e-10


def _tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def _items(x) -> dict:
    """A dict of tensors, a list of per-sequence float lists, or one tensor, as named tensors."""
    if isinstance(x, Mapping):
        return {k: _tensor(v) for k, v in x.items()}
    if isinstance(x, Sequence) and x and not isinstance(x[0], (int, float)):
        return {i: _tensor(v) for i, v in enumerate(x)}
    return {0: _tensor(x)}


def _scale(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def assert_bitwise(a, b) -> None:
    """The same bits: for exact contracts (batch-invariant kernels, cached or copied data)."""
    a, b = _items(a), _items(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k}: not bit for bit equal"


def assert_same_math_fp64(a, b, rel: float = FP64_SAME_MATH) -> None:
    """Two fp64 orders of one computation agree to `rel` of each tensor's largest entry. Values the
    engine reports in fp32 (logprobs, losses) were rounded once more, each by half an fp32 ulp."""
    a, b = _items(a), _items(b)
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].double(), b[k].double()
        bound = rel * _scale(y)
        if torch.float32 in (a[k].dtype, b[k].dtype):
            bound = bound + EPS32 * torch.maximum(x.abs(), y.abs())
        err = (x - y).abs()
        worst = float(err.max()) if err.numel() else 0.0
        assert bool((err <= bound).all()), f"{k}: fp64 paths differ by {worst:.3g} (scale {_scale(y):.3g})"


def assert_same_computation(compute, model32, model64, margin: float = MARGIN) -> None:
    """`compute(model)` runs a reference path and the path under test on `model` and returns their
    results, `(reference, path)`, each a dict of groups (gradients, logprobs, a loss; each a tensor,
    a dict of tensors, a list of float lists or a float). In fp64 the two paths agree to
    `FP64_SAME_MATH`; in fp32 the path is within `margin` times the reference's own fp32 rounding of
    the fp64 result, group by group."""
    ref64, path64 = compute(model64)
    ref32, path32 = compute(model32)
    assert ref64.keys() == path64.keys() == ref32.keys() == path32.keys()
    for group in ref64:
        assert_same_math_fp64(path64[group], ref64[group])
        Rounding(ref32[group], ref64[group]).assert_within(path32[group], margin)


class Rounding:
    """What fp32 rounding does to one computation: its fp32 result beside its fp64 twin.

    `error` is the largest distance of any entry from the fp64 value, relative to its tensor's
    largest entry (at least one fp32 ulp of it); `assert_within(other)` holds when another fp32 path
    is within `margin * error` of the same fp64 values, tensor by tensor.
    """

    def __init__(self, fp32, fp64):
        self.fp32, self.fp64 = _items(fp32), _items(fp64)
        assert self.fp32.keys() == self.fp64.keys()
        rel = [_scale(self.fp32[k].double() - v) / max(_scale(v), 1e-30) for k, v in self.fp64.items()]
        self.error = max([EPS32, *rel])
        assert self.error < 1e-3, f"the fp32 reference itself is {self.error:.3g} from fp64: not rounding"

    def assert_within(self, other32, margin: float = MARGIN) -> None:
        other = _items(other32)
        assert other.keys() == self.fp64.keys()
        for k, want in self.fp64.items():
            err, scale = _scale(other[k].double() - want), _scale(want)
            bound = margin * self.error * scale
            assert err <= bound, (
                f"{k}: {err:.3g} from the fp64 result, beyond {margin} x the fp32 rounding of this "
                f"computation ({self.error:.3g} of the scale {scale:.3g}): {bound:.3g}"
            )


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_k = k*u / (1 - k*u): the relative error bound of a k-term sum or dot product."""
    u = torch.finfo(dtype).eps / 2
    assert k * u < 1
    return k * u / (1 - k * u)


def dot_bound(a: torch.Tensor, b: torch.Tensor, *, kernels: int = 2) -> torch.Tensor:
    """Elementwise bound on |A - B| for two fp32 kernels each computing a @ b (a [..., M, K], b [..., K,
    N]) in any order: kernels * gamma_K * (|a| @ |b|), summed in fp64. With `kernels=1`, the bound on
    one kernel against the exact (fp64) product."""
    k = a.shape[-1]
    return kernels * gamma(k) * (a.double().abs() @ b.double().abs())


def assert_within_bound(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - want| <= bound elementwise (bound from `dot_bound` or a sum of such)."""
    diff = (got.double() - want.double()).abs()
    excess = diff - bound
    if not excess.numel() or float(excess.max()) <= 0:
        return
    worst = int(excess.argmax())
    raise AssertionError(
        f"{what}: element {worst} differs by {float(diff.flatten()[worst]):.3g}, "
        f"beyond its rounding bound {float(bound.expand_as(diff).flatten()[worst]):.3g}"
    )
