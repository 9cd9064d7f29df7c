"""The official, unmodified `pytrio` 0.2.9 client against a real trine server on a tiny model.

The server hands out `model_id` = the model directory, so pytrio loads the tokenizer from disk
(offline); pytrio's telemetry is switched off.

Float comparisons (tests/tolerance.py): one run's computation repeated (a twin run with the same seed
whose calls each run alone, a restored state: its fp32 weights and optimizer moments exactly) is bit
for bit (kind 1); the trainer's logprobs against the sampler's are two engine paths, within
SERVED_PATHS.
"""

from __future__ import annotations

import numpy as np
import pytest
from serverutil import pytrio_env, serve
from tolerance import assert_served_paths

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def trio(tiny_model_dir, tmp_path_factory):
    with (
        serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv,
        pytrio_env(srv.url, srv.api_key) as pytrio,
    ):
        pytrio.server = srv
        yield pytrio


@pytest.fixture(scope="module")
def service(trio):
    client = trio.ServiceClient()
    yield client
    client._runtime.shutdown()  # close the session now, not at exit when the server is gone


def sft_datum(trio, tokens: list[int]):
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


def logprobs(out) -> np.ndarray:
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_sft_loop_loss_falls_with_pipelined_submissions(trio, service):
    tc = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1)
    assert len(tc.get_tokenizer()) == 49152  # loaded offline from the served model directory
    data = [sft_datum(trio, TEXT), sft_datum(trio, TEXT[2:])]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy")  # both submitted before waiting
        opt = tc.optim_step(trio.AdamParams(learning_rate=3e-3))
        out, step = fb.result(), opt.result()
        assert set(out.metrics) == {"loss_sum", "loss_mean", "token_count"}
        assert out.metrics["token_count"] == (len(TEXT) - 1) + (len(TEXT) - 3)
        assert step.metrics["grad_norm"] > 0
        losses.append(out.metrics["loss_mean"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.85 * losses[0], losses


def test_pipelined_and_waiting_loops_give_identical_weights(trio, service):
    """FB, optim, FB, optim sent without waiting execute in index order: same result as waiting."""
    data = [sft_datum(trio, TEXT)]
    adam = trio.AdamParams(learning_rate=1e-3)
    a = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7)
    b = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7)
    futs = [
        a.forward_backward(data, "cross_entropy"),
        a.optim_step(adam),
        a.forward_backward(data, "cross_entropy"),
        a.optim_step(adam),
    ]
    a_losses = [futs[0].result().metrics["loss_sum"], futs[2].result().metrics["loss_sum"]]
    b_losses = []
    for _ in range(2):
        b_losses.append(b.forward_backward(data, "cross_entropy").result().metrics["loss_sum"])
        b.optim_step(adam).result()
    # kind 1: each call of either run runs alone (a's are chained, b's wait), on the same weights
    assert a_losses == b_losses and a_losses[1] < a_losses[0]
    a_lp, b_lp = (logprobs(c.forward(data, "cross_entropy").result()) for c in (a, b))
    assert a_lp.dtype == b_lp.dtype and a_lp.tolist() == b_lp.tolist()


def test_rl_loop_with_grouped_samples_and_importance_sampling(trio, service):
    tc = service.create_lora_training_client(base_model=MODEL, rank=8, seed=3)
    prompt = TEXT[:6]
    group = 4
    for _ in range(2):
        sampler = tc.save_weights_and_get_sampling_client()
        res = sampler.sample(
            prompt=trio.ModelInput.from_ints(prompt),
            num_samples=group,
            sampling_params=trio.SamplingParams(max_tokens=5, temperature=1.0, seed=11),
        ).result()
        assert len(res.sequences) == group
        rewards = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for s in res.sequences]
        mean = sum(rewards) / group
        data = []
        for s, r in zip(res.sequences, rewards):
            assert len(s.logprobs) == len(s.tokens) > 0
            p, c = len(prompt), len(s.tokens)
            data.append(
                trio.Datum(
                    model_input=trio.ModelInput.from_ints(prompt + s.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [0] * (p - 1) + s.tokens,
                        "logprobs": [0.0] * (p - 1) + s.logprobs,
                        "advantages": [0.0] * (p - 1) + [r - mean] * c,
                    },
                )
            )
        out = tc.forward_backward(data, "importance_sampling").result()
        # the trainer scores the sampled tokens exactly as the sampler did (same weights)
        for s, o in zip(res.sequences, out.loss_fn_outputs):
            assert_served_paths(o["logprobs"].to_numpy()[len(prompt) - 1 :], s.logprobs)  # two paths
        assert np.isfinite(out.metrics["loss_sum"])
        tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()


def test_save_state_then_restore_gives_the_same_logprobs(trio, service):
    data = [sft_datum(trio, TEXT)]
    adam = trio.AdamParams(learning_rate=2e-3)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    uri = tc.save_state("restore-me").result().path
    assert uri.startswith("trio://")
    plain = service.create_training_client_from_state(uri)
    with_opt = service.create_training_client_from_state_with_optimizer(uri)
    want = logprobs(tc.forward(data, "cross_entropy").result()).tolist()
    # kind 1 throughout: a state holds the fp32 weights and moments exactly, each call runs alone
    assert logprobs(plain.forward(data, "cross_entropy").result()).tolist() == want
    # one more step from the restored optimizer state matches the original run's next step
    for client in (tc, with_opt):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
    assert (
        logprobs(with_opt.forward(data, "cross_entropy").result()).tolist()
        == logprobs(tc.forward(data, "cross_entropy").result()).tolist()
    )
    loaded = service.create_lora_training_client(base_model=MODEL, rank=4)
    loaded.load_state(uri).result()  # PATCH before the first op
    assert logprobs(loaded.forward(data, "cross_entropy").result()).tolist() == want


def test_sampler_from_saved_weights_and_checkpoint_rest_api(trio, service, tmp_path):
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=9)
    tc.forward_backward([sft_datum(trio, TEXT)], "cross_entropy").result()
    tc.optim_step(trio.AdamParams(learning_rate=5e-3)).result()
    saved = tc.save_weights_for_sampler("for-sampling").result()
    params = trio.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = trio.ModelInput.from_ints(TEXT[:4])
    from_path = service.create_sampling_client(base_model=MODEL, model_path=saved.path)
    temporary = tc.save_weights_and_get_sampling_client()
    a = from_path.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
    b = temporary.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
    assert a.sequences[0].tokens == b.sequences[0].tokens and len(a.sequences[0].tokens) > 0
    lp = from_path.compute_logprobs(trio.ModelInput.from_ints(TEXT)).result()
    assert lp[0] is None and len(lp) == len(TEXT) and all(x <= 0 for x in lp[1:])

    rest = service.create_rest_client()
    cks = rest.list_checkpoints(tc.training_run_cuid).result().checkpoints
    by_path = {c.path: c for c in cks}
    assert saved.path in by_path and by_path[saved.path].checkpoint_type == "sampler"
    ck = by_path[saved.path]
    rest.download_checkpoint(ck.checkpoint_id, tmp_path / "ck.tar").result()
    import tarfile

    with tarfile.open(tmp_path / "ck.tar") as tf:
        names = {n.rsplit("/", 1)[-1] for n in tf.getnames()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names  # a PEFT adapter
    rest.delete_checkpoint(tc.training_run_cuid, ck.checkpoint_id).result()
    left = rest.list_checkpoints(tc.training_run_cuid).result().checkpoints
    assert saved.path not in {c.path for c in left}


def test_base_model_sampler_and_capabilities(trio, service):
    assert service.get_supported_models() == [str(trio.server.service.models[MODEL].dir)]
    sampler = service.create_sampling_client(base_model=MODEL)
    out = sampler.sample(
        prompt=trio.ModelInput.from_ints(TEXT[:5]),
        num_samples=2,
        sampling_params=trio.SamplingParams(max_tokens=3, temperature=0.7, stop=["\n"]),
    ).result()
    assert len(out.sequences) == 2 and out.input_tokens == 5
