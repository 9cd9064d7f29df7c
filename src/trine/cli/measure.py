"""`trine estimate --measure`: this machine's throughput for a model, measured through an embedded
server (the server, scheduler and engine a real job uses), for `metering.wallclock` to predict from.

Each phase is timed after one warm-up call, with token ids spread over the vocabulary:
- prefill: `compute_logprobs` of a prompt of the job's length (a full forward, nothing cached);
- decode: one request of `batch` samples of a short prompt, `DECODE_TOKENS` new tokens (EOS kept: the
  step count is the longest sample's), its prefill subtracted;
- train: `forward_backward` of `batch` sequences of the job's trajectory length (capped at
  TRAIN_TOKENS_MAX), then `optim_step`, each timed on its own.
The server's data dir is a temporary one: the measurement leaves no runs or usage behind.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..metering.wallclock import Throughput

DECODE_TOKENS = 16
PROMPT_TOKENS_MAX = 2048
TRAIN_TOKENS_MAX = 512
MAX_BATCH = 256


def measure(
    model_dir: Path,
    model: str,
    batch: int,
    prompt_tokens: int,
    trajectory_tokens: int,
    threads: int | None = None,
) -> Throughput:
    """The throughput of the model in `model_dir`, recorded under the rate card's name `model`."""
    import torch

    import trine as trio
    from trine.engine.config import EngineConfig
    from trine.server.app import start_server

    batch = max(1, min(batch, MAX_BATCH))
    with tempfile.TemporaryDirectory(prefix="trine-measure-") as home:
        server = start_server(
            models=[model_dir], home=home, port=0, engine=EngineConfig(num_threads=threads or None)
        )
        try:
            with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as service:
                name = model_dir.name
                sampler = service.create_sampling_client(base_model=name)
                ids = lambda n, k=0: [100 + (7919 * (i + k)) % 20000 for i in range(n)]  # noqa: E731
                p = max(16, min(prompt_tokens, PROMPT_TOKENS_MAX))
                sampler.compute_logprobs(trio.ModelInput.from_ints(ids(32, 1))).result()  # warm-up
                prefill_s = _timed(
                    lambda: sampler.compute_logprobs(trio.ModelInput.from_ints(ids(p))).result()
                )
                prefill_rate = p / prefill_s
                params = trio.SamplingParams(max_tokens=DECODE_TOKENS, temperature=1.0, seed=0)
                short = trio.ModelInput.from_ints(ids(16, 2))
                sampler.sample(short, 1, trio.SamplingParams(max_tokens=2)).result()  # warm-up
                t0 = time.perf_counter()
                out = sampler.sample(short, batch, params).result()
                decode_s = time.perf_counter() - t0 - 16 / prefill_rate
                steps = max(len(s.tokens) for s in out.sequences)
                trainer = service.create_lora_training_client(name, rank=16)
                n = max(16, min(trajectory_tokens, TRAIN_TOKENS_MAX))
                data = [
                    trio.Datum(
                        model_input=trio.ModelInput.from_ints(ids(n, k)[:-1]),
                        loss_fn_inputs={"target_tokens": ids(n, k)[1:]},
                    )
                    for k in range(batch)
                ]
                trainer.forward_backward(data[:1], "cross_entropy").result()  # warm-up
                adam = trio.AdamParams(learning_rate=1e-6)
                trainer.optim_step(adam).result()
                train_s = _timed(lambda: trainer.forward_backward(data, "cross_entropy").result())
                optim_s = _timed(lambda: trainer.optim_step(adam).result())
        finally:
            server.stop()
    return Throughput(
        model=model,
        batch=batch,
        prefill_tokens_per_s=prefill_rate,
        decode_step_s=max(decode_s, 1e-6) / max(steps, 1),
        train_tokens_per_s=batch * (n - 1) / train_s,
        optim_step_s=optim_s,
        threads=torch.get_num_threads(),
        device="cuda" if torch.cuda.is_available() else "cpu",
        measured_at=time.time(),
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
