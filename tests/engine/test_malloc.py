"""The C allocator keeps the engine's freed per-step tensors (engine/malloc.py): a decode-heavy run
does not page-fault its logits in afresh every step, unless the operator said otherwise."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from trine.engine.malloc import ENV_NAMES

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")

# 4 prompts x 16 samples: each decode step's logits, softmax and log-softmax are [64, 49152] fp32
# (12.5 MB each, the real tokenizer's vocabulary), freed before the next step.
PROBE = """
import random, resource, sys
from trine.engine.setup import configure
configure()  # as an engine's start does, before its first step
from trine.engine.config import SamplerConfig
from trine.engine.malloc import keep_freed_memory
from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

model, tokenizer = load_model(sys.argv[1], "cpu"), Tokenizer(sys.argv[1])
sampler = Sampler(model, tokenizer, SamplerConfig(kv_cache_bytes=64 << 20))
rng = random.Random(0)

def run(tag):
    opts = SamplingOptions(max_tokens=16, temperature=1.0, seed=0, stop_at_eos=False)
    prompts = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(4)]
    w = WeightsIdentity("t")
    reqs = [SampleRequest(f"{tag}{i}", p, opts, w, num_samples=16) for i, p in enumerate(prompts)]
    sampler.run(reqs)

def measured():
    run("warm")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run("measured")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

if sys.argv[2] == "thread":  # as a server's engine thread runs it
    import threading
    t = threading.Thread(target=measured)
    t.start()
    t.join()
else:
    measured()
print(keep_freed_memory())
"""


def decode_run(model_dir, where: str = "main", **env: str) -> tuple[int, str]:
    """(minor page faults of the second of two identical decode-heavy runs, the allocator's line)."""
    base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_dir), where],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    faults, line = out.stdout.strip().splitlines()[-2:]
    return int(faults), line


# One decode step's logits: [64, 49152] fp32 in 4 KiB pages. The measured run takes 16 decode steps,
# each freeing its logits, softmax and log-softmax: a run that faulted them in afresh every step takes
# about 48 of these (147k faults, what glibc's defaults gave here). With the freed blocks kept, the
# heap may still grow by about one such tensor when a small live block lands at its top, and that can
# happen twice in a run (seen on an Intel Xeon, both kernel paths, main thread and a second one: about
# 50 faults, 3.1k or 6.2k). The bound is four tensors' pages: twice the worst seen, a twelfth of the
# count it guards against. glibc's own dynamic threshold makes the default's count vary from run to
# run (6k to 147k seen under load), so it is not the yardstick.
STEP_LOGITS_PAGES = 64 * 49152 * 4 // 4096
KEPT_BOUND = 4 * STEP_LOGITS_PAGES


def test_a_decode_heavy_run_reuses_its_freed_logits_instead_of_faulting_them_in(tiny_model_dir):
    kept, line = decode_run(tiny_model_dir)
    _, default_line = decode_run(tiny_model_dir, TRINE_MALLOC="default")
    assert line.startswith("glibc malloc: mmap threshold 64 MiB")
    assert default_line.endswith("(TRINE_MALLOC=default)")
    assert kept < KEPT_BOUND, (kept, KEPT_BOUND)


def test_so_does_a_run_in_a_second_thread(tiny_model_dir):
    kept, line = decode_run(tiny_model_dir, "thread")
    assert line.startswith("glibc malloc: mmap threshold 64 MiB")
    assert kept < KEPT_BOUND, (kept, KEPT_BOUND)


def test_an_operators_allocator_settings_are_kept(tiny_model_dir):
    probe = "import trine.engine.malloc as m; print(m.keep_freed_memory())"
    for env in ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}, {"MALLOC_ARENA_MAX": "2"}):
        base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
        out = subprocess.run(
            [sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True
        )
        assert out.stdout.strip() == "glibc malloc: the operator's settings", out.stderr
