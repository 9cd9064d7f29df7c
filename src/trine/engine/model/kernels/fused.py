"""RMSNorm and RoPE of inference forwards, each one pass over its rows: a C kernel (fused_ops.c).

torch runs RMSNorm as five elementwise ops and RoPE as four over a strided view, each a full read
and write of the tensor, and a few microseconds of dispatch each in a decode step (docs/serving.md,
"Where the engine's constants come from").

Invariants
- Used under `torch.inference_mode` (the sampler's forwards) for CPU tensors all fp32 or all bf16,
  with torch's batch-invariant mode off (`suits`). The trainer's forwards, its forward-only
  passes too, take fused_train.py's RMSNorm and torch's RoPE, so `forward` and `forward_backward`
  report the same logprobs bit for bit; CUDA keeps the torch ops.
- rope_ is torch's `apply_rope` bit for bit in either dtype (same products and sums, each rounded
  as torch rounds it, no fused multiply-add); rms_norm is model.RMSNorm's up to float32 rounding
  of the mean of squares (summed in another order; in bf16, then the same roundings to bf16).
- Built at the engine's start (active.py; else at first use, cbuild.py); `TRINE_FUSED_OPS=0` or no
  compiler: the torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import invariant
from .cbuild import Kernel


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    for dt in ("", "_bf16"):
        getattr(lib, "rms_norm" + dt).argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i32]
        getattr(lib, "rope" + dt).argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i32]
        getattr(lib, "rms_norm" + dt).restype = getattr(lib, "rope" + dt).restype = None


# Reassociation lets RMSNorm's sum of squares vectorize; RoPE has no sum, and -ffp-contract=off
# keeps its products and sums rounded one by one, as torch's.
_kernel = Kernel(
    Path(__file__).with_name("fused_ops.c"),
    ("-fassociative-math", "-fno-signed-zeros", "-ffp-contract=off"),
    _declare,
    "TRINE_FUSED_OPS",
)


DTYPES = (torch.float32, torch.bfloat16)


def built() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _kernel.available()


def suits(*tensors: torch.Tensor) -> bool:
    """Whether an RMSNorm or RoPE of these tensors may take the kernel (the module docstring)."""
    return (
        torch.is_inference_mode_enabled()
        and tensors[0].dtype in DTYPES
        and all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors)
        and not invariant.enabled()
        and _kernel.available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.RMSNorm's result (F.rms_norm's in fp32) over x's last dim -> a new contiguous tensor."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    w = weight.detach().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    n, threads = rows.shape[0], torch.get_num_threads()
    fn = _kernel.lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else _kernel.lib.rms_norm
    fn(rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), n, d, eps, threads)
    return out


def rope_suits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_` takes x [B, T, H, D] and cos/sin [B, 1, T, D] as they are laid out: heads
    and dims contiguous within a token, tokens evenly strided (the views of a q/k/v GEMM's
    output), cos and sin contiguous."""
    D = x.shape[3]
    layout = x.stride(3) == 1 and x.stride(2) == D and _token_stride(x) is not None
    return layout and cos.is_contiguous() and sin.is_contiguous() and suits(x, cos, sin)


def _token_stride(x: torch.Tensor) -> int | None:
    """The distance between consecutive tokens of x [B, T, ...] if it is the same throughout (a
    size-1 dim's stride says nothing), else None."""
    B, T = x.shape[:2]
    if T == 1:
        return x.stride(0)
    return x.stride(1) if B == 1 or x.stride(0) == T * x.stride(1) else None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x.transpose(1, 2), cos, sin)` in place on x [B, T, H, D]; returns x. Callers
    check `rope_suits` first."""
    B, T, H, D = x.shape
    c, s = cos.reshape(B * T, D), sin.reshape(B * T, D)
    threads = torch.get_num_threads()
    fn = _kernel.lib.rope_bf16 if x.dtype == torch.bfloat16 else _kernel.lib.rope
    fn(x.data_ptr(), _token_stride(x), H, D, c.data_ptr(), s.data_ptr(), B * T, threads)
    return x
