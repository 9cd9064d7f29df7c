"""A Gated DeltaNet layer's decode step over states updated in place, in C (delta_rule.c):
- `step_`: the gated delta rule alone. It reads and writes each (sequence, head) state once, where
  torch's form (gated_deltanet._step) takes three passes over it (a bmm for k^T S and q^T S, then
  mul_ and baddbmm_).
- `layer_step`: the whole layer between its input projections and out_proj for one token a
  sequence (the conv's step and SiLU, the q/k norms, the gates, the rule, the gated RMSNorm), in
  two parallel passes where torch's form runs about forty small ops.

Invariants
- Used where gated_deltanet._step would take its in-place-capable inference form: CPU fp32 state
  and inputs (a bf16 model's state and rule run in fp32, its wide dtype), no gradients, torch's
  batch-invariant mode off (`suits`). Under batch-invariant kernels the rule keeps its torch form,
  which computes the same bits whatever the batch; this one sums over Dk in index order too, but
  makes no such promise.
- The same math as torch's form: o = decay q^T S + (q . k) delta and S' = decay S + k delta^T with
  delta = (v - decay k^T S) beta; results agree within fp32 rounding (summation order differs).
- `layer_suits` asks `suits`' conditions of the layer's inputs, states and parameters (all fp32,
  row-contiguous); the layer's forward takes it only for one token a row, all rows real, no cuts.
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
    f32 = ctypes.c_float
    lib.linear_attention_step.argtypes = (
        [ptr, i64, ptr, i64, ptr, ptr, i64] + [ptr] * 6 + [f32, f32, ptr, ptr] + [i64] * 6 + [ctypes.c_int]
    )
    lib.linear_attention_step.restype = None


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


def layer_suits(x: torch.Tensor, state, layer) -> bool:
    """Whether `layer`'s (a GatedDeltaNet) decode step from `state` over `x` may take `layer_step`."""
    params = (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    return (
        x.dtype == torch.float32
        and state.conv.dtype == torch.float32
        and all(p.dtype == torch.float32 and p.is_contiguous() for p in params)
        and suits(state.recurrent)
    )


def layer_step(layer, qkv, z, b, a, state, l2_eps: float):
    """One token of `layer` (a GatedDeltaNet) for each of B rows: its input projections' outputs
    qkv [B, 1, conv_dim], z [B, 1, value_dim], b, a [B, 1, Hv] and the rows' `LinearState` ->
    (o [B, 1, value_dim] for out_proj, the conv state after the token, the recurrent state after
    it). A donated state is updated where it lies (its tensors come back); else the caller's is
    left as it was. `l2_eps`: the q/k L2 norm's epsilon."""
    sh = layer.shape
    B = qkv.shape[0]
    # each [B, 1, N] read as B rows a row stride apart (the fused projection's views), last dim contiguous
    qkv, z, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (qkv, z, b, a))
    if b.stride(0) != a.stride(0):
        b, a = b.contiguous(), a.contiguous()
    conv, rec = state.conv, state.recurrent
    if not (state.donated and conv.is_contiguous()):
        conv = conv.clone(memory_format=torch.contiguous_format)
    if not state.donated:
        rec = rec.clone()
    mixed = torch.empty(B, sh.conv_dim)
    o = torch.empty(B, 1, sh.value_dim)
    _kernel.lib.linear_attention_step(
        qkv.data_ptr(),
        qkv.stride(0),
        z.data_ptr(),
        z.stride(0),
        b.data_ptr(),
        a.data_ptr(),
        b.stride(0),
        conv.data_ptr(),
        layer.conv1d.weight.data_ptr(),
        rec.data_ptr(),
        layer.A_log.data_ptr(),
        layer.dt_bias.data_ptr(),
        layer.norm.weight.data_ptr(),
        layer.norm.eps,
        l2_eps,
        mixed.data_ptr(),
        o.data_ptr(),
        B,
        sh.num_key_heads,
        sh.num_value_heads,
        sh.key_head_dim,
        sh.value_head_dim,
        sh.conv_kernel,
        torch.get_num_threads(),
    )
    return o, conv, rec
