"""The environment of the suite's second kernel path on this CPU, printed as `NAME=value` words for
`env` (`make test-portable`).

Floating-point results depend on the kernels a CPU runs: ATen and MKL pick AVX-512 or AVX2 code by
the CPU, and they sum in other orders. A tolerance that holds on one path only is a tolerance tuned
to one machine. So the numerics-sensitive tests run twice in CI: on the CPU's own path, and on the
next lower one, which this script names:
- a CPU where torch runs AVX-512: torch, MKL and oneDNN held to AVX2;
- a CPU where torch runs AVX2 (or less): torch's ATen held to its baseline ("default") kernels. MKL
  ignores MKL_ENABLE_INSTRUCTIONS on AMD CPUs, and its one other path there (MKL_CBWR=COMPATIBLE)
  places a GEMM's rows by their index, which breaks the row-invariance `--batch-invariant` is built
  on (docs/numerics.md), so MKL keeps its path.
The C kernels follow ATEN_CPU_CAPABILITY (cbuild.py), so they are built for the same level.
"""

from __future__ import annotations

import torch

AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
BASELINE = {"ATEN_CPU_CAPABILITY": "default"}


def second_path() -> dict[str, str]:
    native = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    return AVX2 if native.startswith("AVX512") else BASELINE


if __name__ == "__main__":
    print(" ".join(f"{k}={v}" for k, v in second_path().items()))
