"""Decode attention that reads the paged KV pool in place, a C kernel built at the engine's start.

Without it a decode step gathers every key it attends (`index_select` over the pool, one copy of
the whole context per layer) and then runs SDPA over the copy: two passes over memory, both bound
by bandwidth on a CPU. `paged_attention.c` reads each key's K/V rows straight from the pool, once
for all the queries that see it.

Invariants
- Used for CPU decode-sized attention without gradients only (`suits`), fp32 or bf16 (a bf16
  pool's rows widened to fp32 as they are read, the queries and the sums in fp32, the result
  rounded to bf16 once), at most
  `MAX_QUERIES` queries per packed row, torch's batch-invariant mode off (it has its own
  attention). Everything else, CUDA included, gathers and runs SDPA.
- The result is SDPA's up to float32 rounding: the same softmax, summed in another order (in
  bf16, plus the one rounding of the result to bf16).
- A query's result depends on its own keys and their positions (and, in the last bits, on how
  many queries of its packed row see each tile of keys: such a tile is scored as a small GEMM,
  others key by key), never on the other rows of the batch.
- Built at the engine's start (active.py; else at the first decode step; cbuild.py: once per source,
  compiler and CPU, with the system C compiler; it runs on torch's OpenMP threads). Where it cannot
  be built (no compiler, no OpenMP) or `TRINE_PAGED_ATTENTION=0`, `available()` is False and the
  engine gathers as before.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cbuild import Kernel

# Queries per packed row. Up to it the kernel is faster than SDPA over a gathered copy; a prefill
# chunk's many queries are faster through SDPA's GEMMs (docs/serving.md, "Where the engine's
# constants come from").
MAX_QUERIES = 16
DTYPES = (torch.float32, torch.bfloat16)  # of the queries and the pools
# Reassociation lets the dot products and sums vectorize. Not -ffinite-math-only: the
# kernel starts each running max at -inf.
_FLAGS = ("-fassociative-math", "-fno-signed-zeros", "-freciprocal-math")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.paged_attention.restype = None


_kernel = Kernel(
    Path(__file__).with_name("paged_attention.c"),
    _FLAGS,
    _declare,
    "TRINE_PAGED_ATTENTION",
    "gathering the KV instead",
)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _kernel.available()


def suits(q: torch.Tensor, pool: torch.Tensor, mask: torch.Tensor, read: torch.Tensor) -> bool:
    """Whether attention of `q` over `pool` with `mask` [P, 1, Q, L] and slots `read` [P, L]
    should use the kernel (see the module docstring): decode-sized. Slots outside the pool never
    reach the kernel (index_select names them)."""
    from ..invariant import enabled

    Q = mask.shape[2]
    return (
        Q <= MAX_QUERIES
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and pool.dtype == q.dtype
        and pool.is_contiguous()
        and not (torch.is_grad_enabled() and q.requires_grad)
        and not enabled()
        and available()
        and 0 <= int(read.min()) <= int(read.max()) < pool.shape[0]
    )


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, read: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [P, Q, H, D]; pools [slots, KVH, D] (q's dtype: fp32 or bf16); read [P, L] slots; mask
    [P, Q, L] bool (every query sees at least one key) -> [P, Q, H, D] in q's dtype:
    softmax(q k^T / sqrt(D)) v over each query's keys, computed in fp32."""
    P, Q, H, D = q.shape
    KVH, L = k_pool.shape[1], read.shape[1]
    q32, read, mask = q.float().contiguous(), read.long().contiguous(), mask.contiguous()
    out = torch.empty_like(q32)
    _kernel.lib.paged_attention(
        q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), read.data_ptr(), mask.data_ptr(),
        out.data_ptr(), P, Q, L, H, KVH, D, D**-0.5, torch.get_num_threads(),
        int(k_pool.dtype == torch.bfloat16),
    )  # fmt: skip
    return out.to(q.dtype)
