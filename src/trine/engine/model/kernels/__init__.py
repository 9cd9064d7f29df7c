"""The model's CPU kernels: C sources built with the system compiler (cbuild.py; fused_ops.c,
paged_attention.c), the paths that take them (fused.py, paged_attention.py), and the few-row GEMM
kernels (MKL's packed weights, packed.py, fp32; oneDNN's, onednn.py, fp32 and bf16) chosen by
measurement per dtype, shape and row count (gemm.py, gemm_choice.py; their self-checks' bounds,
rounding.py). `active()` builds and chooses them and names those in force (engine start)."""
