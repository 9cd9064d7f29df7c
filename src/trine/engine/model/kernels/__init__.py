"""The model's CPU kernels: C sources built with the system compiler (cbuild.py; fused_ops.c,
paged_attention.c) and the paths that take them or MKL's packed GEMM (fused.py,
paged_attention.py, packed.py). `active()` builds them and names those in force (engine start)."""
