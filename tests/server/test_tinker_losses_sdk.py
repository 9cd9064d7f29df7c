"""The losses Tinker added (gspo, stable_reinforce) through the trine SDK on the PyTRIO wire.

Their values and gradients are checked against reference formulas in test_losses.py; here the SDK
accepts them, `sequence_ratio_mask` travels, and a step trains. (The official pytrio 0.2.9 client
refuses loss names it does not know, so it cannot send them.)
"""

from __future__ import annotations

import math
import os

import pytest
from serverutil import serve
from tolerance import assert_served_paths

import trine as trio

MODEL = "tiny-llama"
PROMPT = [1, 504, 3330, 314, 253, 1345]


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("TRINE_HOME")
    os.environ["TRINE_HOME"] = str(home)
    try:
        with (
            serve(tiny_model_dir, home) as srv,
            trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc,
        ):
            yield svc
    finally:
        os.environ.pop("TRINE_HOME", None) if old is None else os.environ.__setitem__("TRINE_HOME", old)


@pytest.mark.parametrize("loss,extra", [("gspo", True), ("gspo", False), ("stable_reinforce", False)])
def test_tinkers_extra_losses_train_through_the_sdk(service, loss, extra):
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
    sampler = trainer.save_weights_and_get_sampling_client()
    res = sampler.sample(
        trio.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=trio.SamplingParams(max_tokens=4, seed=1),
    ).result()
    p = len(PROMPT) - 1
    data = []
    for seq, adv in zip(res.sequences, (1.0, -1.0)):
        inputs = {
            "target_tokens": [-100] * p + seq.tokens,
            "logprobs": [0.0] * p + seq.logprobs,
            "advantages": [0.0] * p + [adv] * len(seq.tokens),
        }
        if extra:
            inputs["sequence_ratio_mask"] = [0.0] * p + [1.0] * len(seq.tokens)
        data.append(
            trio.Datum(model_input=trio.ModelInput.from_ints(PROMPT + seq.tokens[:-1]), loss_fn_inputs=inputs)
        )
    fb = trainer.forward_backward(data, loss)
    step = trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    out = fb.result()
    assert math.isfinite(out.metrics["loss_sum"]) and step.metrics["grad_norm"] > 0
    for o, seq in zip(
        out.loss_fn_outputs, res.sequences
    ):  # on-policy: the trainer sees the sampler's logprobs
        assert_served_paths(o["logprobs"].tolist()[p:], seq.logprobs)  # two engine paths (tolerance.py)
