"""The engine: models, sampler, trainer and the runtimes that host them (see layout in README).

Importing it (before torch) makes OpenMP's threads sleep rather than spin while they wait
(`OMP_WAIT_POLICY=PASSIVE`, unless the environment already says otherwise): on cores shared with
other processes, spinning threads wait on each other for whole scheduler slices, and decoding
collapsed to about 1 token/s beside a 1-core CPU hog (benchmarks/cpu_share.py; issue 32).
"""

import os
import sys

if "torch" not in sys.modules:  # libgomp reads it once, when torch loads it
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
