"""The gated delta rule's decode step over a recurrent state updated in place: a C kernel
(delta_rule.c) that reads and writes each (sequence, head) state once, where torch's form
(gated_deltanet._step) takes three passes over it (a bmm for k^T S and q^T S, then mul_ and
baddbmm_).

Invariants
- Used where gated_deltanet._step would take its in-place-capable inference form: CPU fp32 state
  and inputs (a bf16 model's state and rule run in fp32, its wide dtype), no gradients, torch's
  batch-invariant mode off (`suits`). Under batch-invariant kernels the rule keeps its torch form,
  which computes the same bits whatever the batch; this one sums over Dk in index order too, but
  makes no such promise.
- The same math as torch's form: o = decay q^T S + (q . k) delta and S' = decay S + k delta^T with
  delta = (v - decay k^T S) beta; results agree within fp32 rounding (summation order differs).
- Built at the engine's start (active.py; else at first use, cbuild.py); `TRINE_DELTA_RULE=0` or
  no compiler: torch's form.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import invariant
from .cbuild import Kernel


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.delta_rule_step.argtypes = [ptr] * 7 + [i64, i64, i64, ctypes.c_int]
    lib.delta_rule_step.restype = None


_kernel = Kernel(Path(__file__).with_name("delta_rule.c"), (), _declare, "TRINE_DELTA_RULE")


def built() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _kernel.available()


def suits(s: torch.Tensor) -> bool:
    """Whether a decode step over state `s` [B, H, Dk, Dv] may take the kernel (the module docstring)."""
    return (
        s.device.type == "cpu"
        and s.dtype == torch.float32
        and s.is_contiguous()
        and not torch.is_grad_enabled()
        and not invariant.enabled()
        and _kernel.available()
    )


def step_(s, q, k, v, decay, beta) -> torch.Tensor:
    """One token of the rule, the new state written over `s` [B, H, Dk, Dv] (fp32, contiguous);
    q, k [B, H, Dk], v [B, H, Dv], decay, beta [B, H] -> o [B, H, Dv]. Callers check `suits` first."""
    B, H, dk, dv = s.shape
    q, k, v, decay, beta = (x.to(torch.float32).contiguous() for x in (q, k, v, decay, beta))
    o = torch.empty(B, H, dv, dtype=torch.float32)
    _kernel.lib.delta_rule_step(
        s.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        decay.data_ptr(),
        beta.data_ptr(),
        o.data_ptr(),
        B * H,
        dk,
        dv,
        torch.get_num_threads(),
    )
    return o
