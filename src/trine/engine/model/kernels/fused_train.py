"""RMSNorm and SwiGLU of the trainer's forwards, with their backward, each one pass: a C kernel
(fused_train.c) behind an autograd Function.

torch's autograd runs RMSNorm as six elementwise ops forward and about eight backward, and SwiGLU
as two forward and three backward; each reads and writes whole activations. In a training step
they are most of the time outside the GEMMs and attention (docs/serving.md, "Training kernels").

Invariants
- Taken outside inference mode (the trainer's forwards, with or without gradients, so `forward`
  and `forward_backward` report the same logprobs bit for bit) for CPU tensors in fp32 or bf16,
  torch's batch-invariant mode off, the kernel built (`suits`). The sampler's forwards run under
  inference mode and take fused.py's kernels or torch's ops.
- The same math as model.RMSNorm / ZeroCenteredRMSNorm and silu(g) * u, up to fp32 rounding: sums
  in another order, and exp within 2 ulp of libm's. bf16 tensors compute in fp32 and are rounded
  once per output (torch's bf16 ops round after each op), in the norm's own order (`round_first`).
- Gradients flow to every input that requires one: x, the weight (summed over rows in fp32, one
  partial per thread, in a fixed order for a given thread count), g and u.
- Built at the engine's start (active.py; else at first use, cbuild.py); `TRINE_FUSED_TRAIN=0` or no
  compiler: the torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import invariant
from .cbuild import Kernel

DTYPES = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.rms_norm_fwd.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rms_norm_fwd_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32, i32]
    lib.rms_norm_bwd.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i32]
    lib.rms_norm_bwd_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i32]
    for dt in ("", "_bf16"):
        getattr(lib, "swiglu_fwd" + dt).argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i32]
        getattr(lib, "swiglu_bwd" + dt).argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i32]
    for name in ("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd"):
        getattr(lib, name).restype = getattr(lib, name + "_bf16").restype = None


_kernel = Kernel(Path(__file__).with_name("fused_train.c"), (), _declare, "TRINE_FUSED_TRAIN")


def built() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _kernel.available()


def suits(*tensors: torch.Tensor) -> bool:
    """Whether a training RMSNorm or SwiGLU over these tensors may take the kernel (the module
    docstring); the first tensor's dtype is the activations'."""
    return (
        not torch.is_inference_mode_enabled()
        and tensors[0].dtype in DTYPES
        and all(t.device.type == "cpu" for t in tensors)
        and not invariant.enabled()
        and _kernel.available()
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as 2-D rows [n, d] with unit stride along d (a view where the layout allows)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
        rows, wf = _rows(x), w.detach().float().contiguous()
        n, d = rows.shape
        out = torch.empty(n, d, dtype=x.dtype)
        rstd = torch.empty(n, dtype=torch.float32)
        lib, threads = _kernel.lib, torch.get_num_threads()
        args = (rows.data_ptr(), rows.stride(0), wf.data_ptr(), out.data_ptr(), rstd.data_ptr(), n, d, eps)
        if _bf16(x):
            lib.rms_norm_fwd_bf16(*args, int(round_first), threads)
        else:
            lib.rms_norm_fwd(*args, threads)
        ctx.save_for_backward(rows, wf, rstd)
        ctx.w_dtype = w.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, wf, rstd = ctx.saved_tensors
        n, d = rows.shape
        dys = _rows(dy)
        dx = torch.empty(n, d, dtype=rows.dtype)
        threads = torch.get_num_threads()
        dw = torch.zeros(threads, d, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        dw_ptr = dw.data_ptr() if dw is not None else None
        lib = _kernel.lib
        common = (
            dys.data_ptr(),
            dys.stride(0),
            rows.data_ptr(),
            rows.stride(0),
            wf.data_ptr(),
            rstd.data_ptr(),
        )
        if _bf16(rows):
            scratch = torch.empty(threads, 3, d, dtype=torch.float32)
            lib.rms_norm_bwd_bf16(*common, dx.data_ptr(), dw_ptr, scratch.data_ptr(), n, d, threads)
        else:
            lib.rms_norm_bwd(*common, dx.data_ptr(), dw_ptr, n, d, threads)
        dw = dw.sum(0).to(ctx.w_dtype) if dw is not None else None
        return dx.view(dy.shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """(x * rstd) * weight over x's last dim, differentiable in x and weight; bf16 rounding in the
    order `round_first` names (fused_train.c). Callers check `suits` first."""
    return _RMSNorm.apply(x, weight, eps, round_first)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        gr, ur = _rows(g), _rows(u)
        n, d = gr.shape
        h = torch.empty(n, d, dtype=g.dtype)
        fn = _kernel.lib.swiglu_fwd_bf16 if _bf16(g) else _kernel.lib.swiglu_fwd
        fn(
            gr.data_ptr(),
            gr.stride(0),
            ur.data_ptr(),
            ur.stride(0),
            h.data_ptr(),
            n,
            d,
            torch.get_num_threads(),
        )
        ctx.save_for_backward(gr, ur)
        return h.view(g.shape)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gr, ur = ctx.saved_tensors
        n, d = gr.shape
        dhr = _rows(dh)
        dg, du = torch.empty(n, d, dtype=gr.dtype), torch.empty(n, d, dtype=gr.dtype)
        fn = _kernel.lib.swiglu_bwd_bf16 if _bf16(gr) else _kernel.lib.swiglu_bwd
        fn(
            dhr.data_ptr(), dhr.stride(0), gr.data_ptr(), gr.stride(0), ur.data_ptr(), ur.stride(0),
            dg.data_ptr(), du.data_ptr(), n, d, torch.get_num_threads(),
        )  # fmt: skip
        return dg.view(dh.shape), du.view(dh.shape)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u, differentiable in both. g and u have the same shape and dtype; callers check
    `suits` first."""
    return _SwiGLU.apply(g, u)
