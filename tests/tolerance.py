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

import math
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

# Two engine paths of the same math, as a server reports them (kind 3, one level up). The server
# serves an fp32 model, so a test through it has no fp64 twin; what it checks is that the service
# moves the engine's numbers intact (the right positions, weights, adapter version, normalisation),
# and an error there is 1e-2 or more. The rounding between two engine paths (the sampler's paged
# attention and packed GEMMs vs the trainer's forward; a cached, chunked or last-n prefill vs a
# whole one; a request's rows in a larger batch; the one-pass custom loss vs the two-pass one) is
# what tests/engine bounds: each path within MARGIN x its fp32 rounding of the fp64 result. That
# rounding, measured once by tests/served_rounding.py on the tiny models (llama, qwen2, qwen3; a
# rank-4 adapter, prompts of 13-71 tokens, sampled and prompt logprobs from the Sampler and the
# Trainer's forward against the same code on the fp64 twin), is at most 2.4e-7 of the logprobs'
# scale (their largest magnitude, 12-13 nats) on AVX2 and on ATen's default kernels with
# MKL_CBWR=COMPATIBLE alike: about two fp32 ulps of the log-sum-exp; the two fp32 paths differ by
# at most 2.3e-7 of it (2.9e-6 nats). So SERVED_ROUNDING = 2.5e-7 and two served paths are within
# 2 x MARGIN x that of each other: 2e-6 of the scale, 2.6e-5 nats for these models, 400x below a
# plumbing error.
SERVED_ROUNDING = 2.5e-7
SERVED_PATHS = 2 * MARGIN * SERVED_ROUNDING
# The same for a quantity of the gradient (a grad norm from optim_step): the trainer's fp32 grad
# norm was within 9.6e-7 of its fp64 twin's on both kernel paths (a cross-entropy step on the same
# prompts and models), so two paths are within 2 x MARGIN x 1e-6 of each other: 8e-6 of it.
SERVED_GRAD_ROUNDING = 1e-6
SERVED_GRAD_PATHS = 2 * MARGIN * SERVED_GRAD_ROUNDING


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


def assert_same_computation(
    compute, model32, model64, margin: float = MARGIN, ratio_of: Mapping[str, str] | None = None
) -> None:
    """`compute(model)` runs a reference path and the path under test on `model` and returns their
    results, `(reference, path)`, each a dict of groups (gradients, logprobs, a loss; each a tensor,
    a dict of tensors, a list of float lists or a float). In fp64 the two paths agree to
    `FP64_SAME_MATH`; in fp32 the path is within `margin` times the reference's own fp32 rounding of
    the fp64 result, group by group.

    `ratio_of` maps a group to the group it is exp(x - c) times a factor of, elementwise (a policy
    loss of its logprobs): an absolute error d in x is a relative error d in it, so its rounding is
    at least x's absolute rounding. Its own reference may happen to round its largest entries less
    than the path does (measured: 4-5x less on AVX2), which no margin on its own rounding bounds."""
    ref64, path64 = compute(model64)
    ref32, path32 = compute(model32)
    assert ref64.keys() == path64.keys() == ref32.keys() == path32.keys()
    ratio_of = ratio_of or {}
    for group in ref64:
        try:
            assert_same_math_fp64(path64[group], ref64[group])
            floor = 0.0
            if group in ratio_of:
                x = ratio_of[group]
                floor = Rounding(ref32[x], ref64[x]).absolute
            Rounding(ref32[group], ref64[group], floor=floor).assert_within(path32[group], margin)
        except AssertionError as e:
            raise AssertionError(f"{group}: {e}") from None


class Rounding:
    """What fp32 rounding does to one computation: its fp32 result beside its fp64 twin.

    `error` is the largest distance of any entry from the fp64 value, relative to its tensor's
    largest entry (at least one fp32 ulp of it, and at least `floor`); `absolute` is that distance
    itself. `assert_within(other)` holds when another fp32 path is within `margin * error` of the
    same fp64 values, tensor by tensor.
    """

    def __init__(self, fp32, fp64, floor: float = 0.0):
        self.fp32, self.fp64 = _items(fp32), _items(fp64)
        assert self.fp32.keys() == self.fp64.keys()
        diffs = {k: _scale(self.fp32[k].double() - v) for k, v in self.fp64.items()}
        self.absolute = max(diffs.values(), default=0.0)
        rel = [diffs[k] / max(_scale(v), 1e-30) for k, v in self.fp64.items()]
        self.error = max([EPS32, floor, *rel])
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


def assert_served_paths(got, want, rel: float = SERVED_PATHS, *, scale: float | None = None) -> None:
    """Two engine paths of the same math, as a server reports them (logprobs, the top-k logprobs of
    a row): within `rel` of the values' scale (their largest magnitude), elementwise. For a value
    derived from logprobs (a mean, a sum of n of them), pass `scale`: the logprobs' scale times
    what the derivation multiplies an error by (1 for a mean, n for a sum). None entries (a
    prompt's first position) must be None on both sides."""
    got, want = list(got) if _listlike(got) else [got], list(want) if _listlike(want) else [want]
    assert len(got) == len(want), f"{len(got)} values against {len(want)}"
    assert [g is None for g in got] == [w is None for w in want], "None at other positions"
    a = torch.tensor([float(g) for g in got if g is not None], dtype=torch.float64)
    b = torch.tensor([float(w) for w in want if w is not None], dtype=torch.float64)
    scale = max(_scale(a), _scale(b)) if scale is None else scale
    bound = rel * scale
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= bound, (
        f"two served paths differ by {err:.3g}, beyond {rel:.3g} of the scale {scale:.3g}: {bound:.3g}"
    )


def _listlike(x) -> bool:
    return not isinstance(x, (int, float)) and hasattr(x, "__len__")


def assert_sum_of(total: float, terms, dtype: torch.dtype = torch.float64, *, term_rel: float = 0.0) -> None:
    """Kind 2: `total` is the sum of `terms` (values reported beside it, or computed here in fp64
    from them) added in `dtype` in some order: within gamma_n * sum|x| of their exact sum (Higham,
    sec. 4.2: any order), plus `term_rel` * sum|x| where the engine evaluated each term itself in
    fp32 (a few roundings: term_rel is their count times EPS32 / 2)."""
    xs = [float(x) for x in terms]
    exact = math.fsum(xs)
    bound = (gamma(max(len(xs), 1), dtype) + term_rel) * math.fsum(abs(x) for x in xs)
    assert abs(total - exact) <= bound, (
        f"{total!r} is not the sum {exact!r} of its {len(xs)} terms (bound {bound:.3g})"
    )


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


def assert_same_samples(compute, model32, model64, margin: float = MARGIN) -> None:
    """`assert_same_computation` for paths that also choose tokens: `compute(model)` returns
    `(reference, path, chosen)`, `chosen` the exact things (token ids) both paths picked, which must
    be the same in fp32 and fp64 for their logprobs to be comparable. On a random model a token
    flips between them only if two logits (or a draw and a CDF step) lie within fp32 rounding, about
    1e-6, of each other; the fixed prompts and seeds here have none."""
    chosen = []

    def run(model):  # fp64 first, then fp32: their choices are compared before their values
        ref, path, picked = compute(model)
        assert not chosen or picked == chosen[0], "fp32 and fp64 chose different tokens"
        chosen.append(picked)
        return ref, path

    assert_same_computation(run, model32, model64, margin)


def fp64_model(path):
    """The checkpoint at `path` as an fp64 model: the same weights (fp32 values, exactly in fp64)
    and the same fp32 RoPE frequencies, so it computes the fp32 model's math with 2^29 times less
    rounding (the engine keeps an fp64 model in fp64 throughout: `invariant.wide_dtype`)."""
    from trine.engine.model.weights import load_model

    return load_model(path, "cpu", torch.float64)


def fp64_adapter(adapter, model64):
    """A copy of `adapter` (its config, its parameters' values exactly) on `model64`."""
    from trine.engine.model.lora import Adapter

    twin = Adapter(model64, adapter.config)
    with torch.no_grad():
        for (n, p), (m, q) in zip(adapter.named_parameters(), twin.named_parameters(), strict=True):
            assert n == m
            q.copy_(p)
    return twin


def linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, kernels: int = 2):
    """`dot_bound` for F.linear(x, weight, bias): the bias is one more term of each dot product."""
    a, b = x.reshape(-1, x.shape[-1]), weight.t()
    if bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        b = torch.cat([b, bias[None]], 0)
    return dot_bound(a, b, kernels=kernels).view(*x.shape[:-1], weight.shape[0])


def bf16_linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, want: torch.Tensor):
    """Kind 2 for two bf16 kernels of F.linear(x, weight, bias) on the same bf16 inputs, `want` one
    of them: elementwise bound (fp64) on |got - want|. Each product of two bf16 values is exact in
    fp32, each kernel sums the K terms (the bias one more) in fp32 in an order of its own (within
    gamma_K S of the exact E, S = sum|x w| + |bias|), then rounds to bf16 once (u = 2^-8). With A, B
    the fp32 sums and b = bf16(B) = want: |a - b| <= u|A| + 2 gamma_K S + u|B|, |B| <= |b| / (1 - u)
    and |A| <= |B| + 2 gamma_K S, so |a - b| <= 2 (u |want| + gamma_K S) (1 + 2u) / (1 - u). A kernel
    rounding x w to bf16 before adding the bias rounds once more: u (1 + gamma_K) sum|x w| each."""
    u = 2.0**-8
    xw = x.reshape(-1, x.shape[-1]).double().abs() @ weight.double().abs().t()
    k, s = x.shape[-1], xw
    if bias is not None:
        k, s = k + 1, xw + bias.double().abs()
    g = gamma(k)
    bound = 2 * (u * want.reshape(xw.shape).double().abs() + g * s) * (1 + 2 * u) / (1 - u)
    if bias is not None:
        bound = bound + 2 * u * (1 + g) * xw
    return bound.view(*x.shape[:-1], weight.shape[0])


def attention_bound(q, k, v, mask):
    """The exact (fp64) attention softmax(q k^T / sqrt(D)) v and an a-priori bound on any fp32
    kernel's distance from it, elementwise. q [N, H, T, D], k/v [N, KVH, L, D], mask [N, 1, T, L]
    bool (every query sees a key).

    From `dot_bound`: a score s_j = q.k_j / sqrt(D) is within d_j = gamma_{D+1} |q|.|k_j| / sqrt(D)
    (the scaling one more rounding), and exp(s_j - max) is taken of an argument rounded once more
    (u |s_j - max|). Perturbing the scores by at most d = max_j d_j moves each softmax weight by a
    factor within exp(+-2d); exp, the L-term denominator, the division and an online softmax's
    rescalings (one per key at most, each an exp and a product) add gamma_{3L+8} relatively. The
    output's L-term sum adds gamma_L of sum_j p_j |v_j|. So |out - exact| <= (exp(2d) - 1 +
    gamma_{4L+8}) * sum_j p_j |v_j|, to first order in u."""
    N, H, T, D = q.shape
    kvh, L = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(H // kvh, 1), v.double().repeat_interleave(H // kvh, 1)
    mask = mask.expand(N, H, T, L)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~mask, -math.inf)
    p = s.softmax(-1)
    exact = p @ v
    u = EPS32 / 2
    d = gamma(D + 1) * (q.abs() @ k.abs().transpose(-1, -2)) / math.sqrt(D)
    d = d + u * (s - s.amax(-1, keepdim=True)).abs()
    d = d.masked_fill(~mask, 0).amax(-1, keepdim=True)  # [N, H, T, 1]
    bound = (torch.expm1(2 * d) + gamma(4 * L + 8)) * (p @ v.abs())
    return exact, bound


def rms_norm_bound(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The exact (fp64) RMSNorm w * x / sqrt(mean(x^2) + eps) over the last dim (d), and an
    a-priori bound on any fp32 kernel's distance from it, elementwise: the squares and their
    d-term sum, the division by d and the eps add gamma_{d+3} to mean(x^2), of which the square
    root halves the relative error; the rsqrt (or a sqrt and a division: 2 roundings), x times
    it, (a rounding to the dtype) and times w add gamma_5. So |y - exact| <= (gamma_{d+3} / 2 +
    gamma_5) * |exact|, to first order."""
    d = x.shape[-1]
    xd, wd = x.double(), weight.double()
    exact = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
    return exact, (gamma(d + 3) / 2 + gamma(5)) * exact.abs()
