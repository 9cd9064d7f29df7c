"""The trine SDK end to end over HTTP against a real server on a tiny model.

One server and one ServiceClient per module; each test makes its own training runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re

import httpx
import pytest
import torch
from serverutil import serve
from tolerance import assert_served_paths, assert_sum_of

import trine as trio
from trine.client.batch import Limits
from trine.errors import EventFailedError

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("sdk-home")
    old = os.environ.get("TRINE_HOME")
    os.environ["TRINE_HOME"] = str(home)  # the SDK's tokenizer cache goes here too
    try:
        with serve(tiny_model_dir, home) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("TRINE_HOME", None)
        else:
            os.environ["TRINE_HOME"] = old


@pytest.fixture(scope="module")
def service(server):
    with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as svc:
        yield svc


@pytest.fixture(scope="module")
def tokenizer(service):
    return service.create_lora_training_client(MODEL, rank=4).get_tokenizer()


def sft_datum(tokenizer, text: str) -> trio.Datum:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
    )


def test_sft_loss_falls_and_pipelined_steps_share_cycles(service, tokenizer):
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=0)
    batch = [
        sft_datum(tokenizer, "The capital of France is Paris."),
        sft_datum(tokenizer, "Two plus two equals four."),
    ]
    losses, cycles = [], []
    for _ in range(8):
        fb = trainer.forward_backward(batch, "cross_entropy")
        opt = trainer.optim_step(trio.AdamParams(learning_rate=1e-2))
        out, step = fb.result(), opt.result()
        losses.append(out.metrics["loss_mean"])
        cycles += [out.cycle, step.cycle]
        assert "grad_norm" in step.metrics
    assert losses[-1] < 0.5 * losses[0]
    assert cycles == sorted(cycles) and len(set(cycles[1::2])) == 8
    n = sum(len(d.model_input) for d in batch)
    assert out.usage.train_tokens == n and out.usage.loss_tokens == n == out.metrics["token_count"]
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[len(d.model_input)] for d in batch]


def test_rl_loop_with_importance_sampling(service, tokenizer):
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=1)
    prompt = tokenizer.encode("Count with me: one, two,", add_special_tokens=False)
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    for _step in range(2):
        sampler = trainer.save_weights_and_get_sampling_client()
        res = sampler.sample(
            trio.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params
        ).result()
        assert len(res.sequences) == 4
        rewards = [float(len(set(s.tokens))) for s in res.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for seq, r in zip(res.sequences, rewards):
            assert len(seq.logprobs) == len(seq.tokens) and all(math.isfinite(x) for x in seq.logprobs)
            p = len(prompt) - 1
            data.append(
                trio.Datum(
                    model_input=trio.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [-100] * p + seq.tokens,
                        "logprobs": [0.0] * p + seq.logprobs,
                        "advantages": [0.0] * p + [r - mean + 0.5] * len(seq.tokens),
                    },
                )
            )
        fb = trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        out = fb.result()
        # the trainer's logprobs of the sampled tokens match the sampler's (same weights)
        for _datum, o, seq in zip(data, out.loss_fn_outputs, res.sequences):
            trained = o["logprobs"].tolist()[len(prompt) - 1 :]
            assert_served_paths(trained, seq.logprobs)  # two engine paths (tests/tolerance.py)
        assert out.usage.loss_tokens == sum(len(s.tokens) for s in res.sequences)


def test_save_state_then_a_new_client_from_it_gives_the_same_logprobs(service, tokenizer):
    batch = [sft_datum(tokenizer, "Checkpoints must restore exactly.")]
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=2)
    for _ in range(2):
        trainer.forward_backward(batch)
        trainer.optim_step(trio.AdamParams(learning_rate=1e-2))
    saved = trainer.save_state("after-two-steps").result()
    assert saved.path and saved.size > 0 and saved.type == "save-checkpoint"
    expected = trainer.forward(batch).result().loss_fn_outputs[0]["logprobs"].tolist()

    # bit for bit (kind 1): a state holds the fp32 weights exactly, and each forward runs alone
    restored = service.create_training_client_from_state(saved.path)
    assert restored.training_run_id != trainer.training_run_id and restored.lora.rank == 8
    assert restored.forward(batch).result().loss_fn_outputs[0]["logprobs"].tolist() == expected

    with_optimizer = service.create_training_client_from_state_with_optimizer(saved.path)
    assert with_optimizer.forward(batch).result().loss_fn_outputs[0]["logprobs"].tolist() == expected

    loaded = service.create_lora_training_client(MODEL, rank=8)
    assert loaded.load_state(saved.path).result() == {}
    assert loaded.forward(batch).result().loss_fn_outputs[0]["logprobs"].tolist() == expected
    with pytest.raises(trio.ValidationError, match="before the first training call"):
        loaded.load_state(saved.path)
    other_rank = service.create_lora_training_client(MODEL, rank=4)
    with pytest.raises(trio.ValidationError, match="lora_rank"):
        other_rank.load_state(saved.path)


def test_a_sampler_from_saved_weights_serves_exactly_those_weights(service, tokenizer):
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=3)
    batch = [sft_datum(tokenizer, "Samplers load saved adapters.")]
    trainer.forward_backward(batch)
    trainer.optim_step(trio.AdamParams(learning_rate=5e-2))
    saved = trainer.save_weights_for_sampler("sampler-weights").result()
    assert saved.type == "save-weights" and saved.size > 0
    prompt = trio.ModelInput.from_ints(batch[0].model_input.to_ints())
    greedy = trio.SamplingParams(max_tokens=5, temperature=0.0)

    from_path = service.create_sampling_client(base_model=MODEL, model_path=saved.path)
    from_trainer = trainer.create_sampling_client(saved.path)
    base = service.create_sampling_client(base_model=MODEL)
    a, b, c = (s.sample(prompt, sampling_params=greedy) for s in (from_path, from_trainer, base))
    assert a.result().sequences[0].tokens == b.result().sequences[0].tokens

    logprobs = from_path.compute_logprobs(prompt).result()
    trained = trainer.forward(batch).result().loss_fn_outputs[0]["logprobs"].tolist()
    assert logprobs[0] is None and len(logprobs) == len(prompt)
    assert_served_paths(logprobs[1:], trained[:-1])  # the sampler's prefill vs the trainer's forward
    base_logprobs = base.compute_logprobs(prompt).result()
    # the adapter changed the model: by more than 1e-3 somewhere, 40x what two paths' rounding can
    # do (SERVED_PATHS: 2.6e-5 nats here), so rounding alone cannot pass this
    assert base_logprobs[1:] != pytest.approx(logprobs[1:], abs=1e-3)
    assert c.result().sequences


def test_pipelined_submissions_run_in_order(service, tokenizer):
    """forward_backward, optim_step, ... submitted without waiting give exactly the losses of a loop
    that waits on every call, and their cycle numbers follow submission order."""
    batch = [sft_datum(tokenizer, "Order matters for optimizers.")]
    adam = trio.AdamParams(learning_rate=2e-2)

    naive = service.create_lora_training_client(MODEL, rank=8, seed=4)
    naive_losses = []
    for _ in range(3):
        naive_losses.append(naive.forward_backward(batch).result().metrics["loss_sum"])
        naive.optim_step(adam).result()

    piped = service.create_lora_training_client(MODEL, rank=8, seed=4)
    futures = []
    for _ in range(3):
        futures.append(piped.forward_backward(batch))
        futures.append(piped.optim_step(adam))
    last = piped.forward(batch)
    results = [f.result() for f in futures]
    # exactly (kind 1): the same run's calls in the same order, each alone in its trainer call
    assert [r.metrics["loss_sum"] for r in results[::2]] == naive_losses
    cycles = [r.cycle for r in results] + [last.result().cycle]
    assert cycles == sorted(cycles) and cycles[1] < cycles[2] and cycles[3] < cycles[4]


def test_a_pipelined_step_takes_one_clock_cycle_and_a_waiting_one_two(tiny_model_dir, tmp_path, tokenizer):
    """With a gather window longer than one HTTP round trip (so a loaded test machine cannot
    split a step), submitting optim_step before waiting puts it in its forward_backward's cycle."""
    batch = [sft_datum(tokenizer, "Clock cycles are shared.")]
    with (
        serve(tiny_model_dir, tmp_path / "home", gather_seconds=0.3) as srv,
        trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc,
    ):
        trainer = svc.create_lora_training_client(MODEL, rank=4)
        trainer.forward(batch).result()
        piped = []
        for _ in range(3):
            fb, opt = trainer.forward_backward(batch), trainer.optim_step(trio.AdamParams())
            piped.append((fb.result().cycle, opt.result().cycle))
        waited = []
        for _ in range(3):
            fb = trainer.forward_backward(batch).result()
            waited.append((fb.cycle, trainer.optim_step(trio.AdamParams()).result().cycle))
    assert all(a == b for a, b in piped)
    assert all(a < b for a, b in waited)


def test_futures_work_with_result_await_and_map(service, tokenizer):
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=5)
    batch = [sft_datum(tokenizer, "Futures resolve once.")]

    async def main():
        fb = await trainer.forward_backward_async(batch)
        opt = await trainer.optim_step_async(trio.AdamParams())
        out = await fb
        await opt
        sampler = await trainer.save_weights_and_get_sampling_client_async()
        res = await sampler.sample_async(
            trio.ModelInput.from_ints([1, 2, 3]), sampling_params=trio.SamplingParams(max_tokens=2)
        )
        lps = await sampler.compute_logprobs_async(trio.ModelInput.from_ints([1, 2, 3]))
        both = await asyncio.gather(
            sampler.sample(
                trio.ModelInput.from_ints([4, 5]), sampling_params=trio.SamplingParams(max_tokens=1)
            ),
            sampler.sample(
                trio.ModelInput.from_ints([6, 7]), sampling_params=trio.SamplingParams(max_tokens=1)
            ),
        )
        return out, res, lps, both

    out, res, lps, both = asyncio.run(main())
    assert out.metrics["token_count"] > 0 and len(res.sequences[0].tokens) <= 2 and len(lps) == 3
    assert all(len(b.sequences) == 1 for b in both)
    fut = trainer.forward(batch)
    mapped = fut.map(lambda o: o.metrics["loss_sum"])
    assert mapped.result(timeout=60) == fut.result().metrics["loss_sum"] and fut.done()
    assert isinstance(fut, trio.APIFuture)


def test_usage_is_reported_by_phase_and_adds_up(service, tokenizer):
    sampler = service.create_sampling_client(base_model=MODEL)
    before = service.usage()
    prompt = trio.ModelInput.from_ints(
        tokenizer.encode(
            "A prompt long enough to fill a few cache blocks of sixteen "
            "tokens each, so that a repeat hits the prefix cache.",
            add_special_tokens=False,
        )
    )
    params = trio.SamplingParams(max_tokens=3, temperature=0.0)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result().usage
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result().usage
    scored = sampler.compute_logprobs(prompt).result().usage
    for u in (first, again, scored):
        assert u.prompt_tokens == u.prefill_tokens + u.cached_tokens == len(prompt)
    assert first.prefill_tokens == len(prompt)  # one prefill for the group of 3
    assert first.sample_tokens == 9
    assert again.cached_tokens > 0 and again.prefill_tokens >= 1
    assert scored.cached_tokens == 0 and scored.sample_tokens == 0

    trainer = service.create_lora_training_client(MODEL, rank=4)
    ids = prompt.to_ints()
    weighted = trio.Datum(
        model_input=trio.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.0] * 10 + [1.0] * (len(ids) - 11)},
    )
    train = trainer.forward_backward([weighted]).result().usage
    assert (train.train_tokens, train.loss_tokens) == (len(ids) - 1, len(ids) - 11)

    spent = service.usage()
    for field in (
        "prompt_tokens",
        "prefill_tokens",
        "cached_tokens",
        "sample_tokens",
        "train_tokens",
        "loss_tokens",
    ):
        assert getattr(spent, field) - getattr(before, field) == sum(
            getattr(u, field) for u in (first, again, scored, train)
        ), field
    assert sampler.usage().sample_tokens == 18 and trainer.usage().train_tokens == len(ids) - 1


def test_results_are_priced_from_the_servers_rate_card(service, tokenizer):
    [model] = [m for m in service.get_server_capabilities().supported_models if m.alias == MODEL]
    price = model.pricing  # USD per million tokens by phase
    assert price["train"] == price["sample"] > price["prefill"] > price["prefill_cached"] > 0
    sampler = service.create_sampling_client(base_model=MODEL)
    prompt = trio.ModelInput.from_ints(tokenizer.encode("Price this prompt, twice over: " * 4))
    params = trio.SamplingParams(max_tokens=2, temperature=0.0)
    for _ in range(2):  # the second request is partly cached, and cheaper for it
        u = sampler.sample(prompt, num_samples=2, sampling_params=params).result().usage
        expected = (
            u.prefill_tokens * price["prefill"]
            + u.cached_tokens * price["prefill_cached"]
            + u.sample_tokens * price["sample"]
        ) / 1e6
        # a handful of correctly rounded fp64 products and sums in another order (the card's prices
        # keep every amount a multiple of 1e-8, which money's 12 decimals keep): ~1e-15 relative
        assert u.cost == pytest.approx(expected, rel=1e-12, abs=0)
    trainer = service.create_lora_training_client(MODEL, rank=4)
    before = service.usage()
    u = trainer.forward_backward([sft_datum(tokenizer, "priced training text")]).result().usage
    assert u.cost == pytest.approx(u.train_tokens * price["train"] / 1e6, rel=1e-12, abs=0)  # as above
    # two totals, each rounded to money's 12 decimals (half of 1e-12 each), their difference
    assert (service.usage() - before).cost == pytest.approx(u.cost, rel=0, abs=1e-12)


def test_bad_input_is_refused_client_side_with_clear_messages(service, tokenizer):
    trainer = service.create_lora_training_client(MODEL, rank=4)
    good = sft_datum(tokenizer, "valid text")
    with pytest.raises(trio.ValidationError, match="Unsupported loss function"):
        trainer.forward_backward([good], "hinge")
    with pytest.raises(trio.ValidationError, match="outside the vocabulary"):
        trainer.forward_backward(
            [
                trio.Datum(
                    model_input=trio.ModelInput.from_ints([1, 10**6]),
                    loss_fn_inputs={"target_tokens": [1, 2]},
                )
            ]
        )
    with pytest.raises(trio.ValidationError, match=r"target_tokens'\] must have shape"):
        trainer.forward_backward(
            [
                trio.Datum(
                    model_input=trio.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [1, 2]}
                )
            ]
        )
    with pytest.raises(trio.ValidationError, match="logprobs'\\] is required"):
        trainer.forward_backward([good], "importance_sampling")
    with pytest.raises(trio.ValidationError, match="adam_params"):
        trainer.optim_step({"learning_rate": 1.0})
    with pytest.raises(trio.ValidationError, match="checkpoint name"):
        trainer.save_state("bad/name")
    with pytest.raises(ValueError, match=r"rank must be in \[4, 64\]"):
        service.create_lora_training_client(MODEL, rank=2)
    sampler = service.create_sampling_client(base_model=MODEL)
    with pytest.raises(trio.ValidationError, match="max_tokens must be set"):
        sampler.sample(trio.ModelInput.from_ints([1, 2]))
    with pytest.raises(trio.ValidationError, match="prompt is empty"):
        sampler.sample(trio.ModelInput.from_ints([]), sampling_params=trio.SamplingParams(max_tokens=1))
    with pytest.raises(trio.ValidationError, match="num_samples"):
        sampler.sample(
            trio.ModelInput.from_ints([1]), num_samples=0, sampling_params=trio.SamplingParams(max_tokens=1)
        )
    # errors only the server can see come back with its code and message
    with pytest.raises(trio.ControlAPIError) as e:
        service.create_lora_training_client("no-such-model")
    assert e.value.status_code == 404 and "no-such-model" in str(e.value)
    # the run is unharmed by all of the above
    assert trainer.forward_backward([good]).result().metrics["token_count"] > 0


def test_an_event_the_server_refuses_fails_only_its_future(service):
    trainer = service.create_lora_training_client(MODEL, rank=4)
    ok = trio.Datum(
        model_input=trio.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
    )
    policy = trio.Datum(
        model_input=trio.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3},
    )
    first = trainer.forward_backward([ok])
    refused = trainer.forward_backward([policy], "ppo", loss_fn_config={"clip_epsilon": 0.2})  # not a ppo key
    after = trainer.forward_backward([ok])
    with pytest.raises(EventFailedError, match="clip_epsilon") as e:  # it took its index, and failed
        refused.result(timeout=60)
    assert e.value.code == "validation_failed"
    assert first.result().metrics["token_count"] == after.result().metrics["token_count"] == 3


def test_a_batch_split_into_chunks_equals_the_whole_batch(service, tokenizer):
    batch = [sft_datum(tokenizer, t) for t in ("one small text", "another small text", "a third one")]
    whole = service.create_lora_training_client(MODEL, rank=4, seed=6)
    split = service.create_lora_training_client(MODEL, rank=4, seed=6)
    split._limits = Limits(max_batch_size=1)  # as if the server limited batches to one sample
    a, b = whole.forward_backward(batch).result(), split.forward_backward(batch).result()
    # three datums in one trainer call or one each: two engine paths (packed rows), within
    # SERVED_PATHS of the logprobs' scale; loss_sum adds n of them, loss_mean averages them
    lp_a = [x for o in a.loss_fn_outputs for x in o["logprobs"].tolist()]
    lp_b = [x for o in b.loss_fn_outputs for x in o["logprobs"].tolist()]
    scale, n = max(abs(x) for x in lp_a), a.metrics["token_count"]
    assert b.metrics.keys() == a.metrics.keys() and b.metrics["token_count"] == n
    assert_served_paths(b.metrics["loss_sum"], a.metrics["loss_sum"], scale=n * scale)
    assert_served_paths(b.metrics["loss_mean"], a.metrics["loss_mean"], scale=scale)
    assert b.usage.train_tokens == a.usage.train_tokens
    assert_served_paths(lp_b, lp_a)
    whole.optim_step(trio.AdamParams(learning_rate=1e-2))
    split.optim_step(trio.AdamParams(learning_rate=1e-2))
    after_a, after_b = whole.forward(batch).result(), split.forward(batch).result()
    # the two gradients' rounding moves AdamW's first step (lr * m / sqrt(v), lr * sign(g) up to a
    # few roundings) in its last bits only: the forwards after it are two paths, as above. (A weight
    # whose gradient is within rounding of 0 may step either way, 2 lr apart, but the loss's gradient
    # there is that ~0: loss_sum moves by it only at second order.)
    assert_served_paths(after_b.metrics["loss_sum"], after_a.metrics["loss_sum"], scale=n * scale)


def test_forward_backward_custom_matches_cross_entropy(service, tokenizer):
    batch = [sft_datum(tokenizer, "Custom losses are linearised.")]
    ce = service.create_lora_training_client(MODEL, rank=4, seed=7)
    custom = service.create_lora_training_client(MODEL, rank=4, seed=7)

    def nll(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom_nll": loss.item()}

    out = custom.forward_backward_custom(batch, nll).result()
    ce_out = ce.forward_backward(batch).result()
    # the custom path's forward and ce's forward_backward compute the same logprobs (one datum alone,
    # the same weights: kind 1), which the client adds in fp32 and the engine in fp64 (kind 2 each)
    lp = [x for o in ce_out.loss_fn_outputs for x in o["logprobs"].tolist()]
    assert_sum_of(ce_out.metrics["loss_sum"], [-x for x in lp])
    assert_sum_of(out.metrics["custom_nll"], [-x for x in lp], torch.float32)
    for t in (ce, custom):
        t.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    # bit for bit: the linearised loss's weights are -dC/dlogp = 1.0 exactly, so the custom run's
    # backward is ce's, and so are its step and its weights
    assert (
        custom.forward(batch).result().metrics["loss_sum"] == ce.forward(batch).result().metrics["loss_sum"]
    )


def test_tokenizer_is_served_by_the_server_and_cached(service, server, tmp_path, monkeypatch):
    trainer = service.create_lora_training_client(MODEL, rank=4)
    local = trainer.get_tokenizer()
    text = local.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text
    # a client on another machine cannot read the server's model dir: it downloads the files once
    monkeypatch.setenv("TRINE_HOME", str(tmp_path))
    remote = service._session.get_tokenizer("/not/on/this/machine", MODEL)
    assert (tmp_path / "tokenizers" / MODEL / "tokenizer.json").is_file()
    assert remote.encode("hello there") == local.encode("hello there") and len(remote) == len(local)
    from trine.client.tokenizer import resolve_local

    assert resolve_local("/not/on/this/machine", MODEL) is not None  # served from the cache now
    assert resolve_local("/another/model", MODEL) is None  # a different model is not


def test_rest_client_runs_checkpoints_and_downloads(service, tokenizer, tmp_path):
    trainer = service.create_lora_training_client(MODEL, rank=4)
    trainer.forward_backward([sft_datum(tokenizer, "the rest client lists this run")])
    state = trainer.save_state("rest-state").result()
    weights = trainer.save_weights_for_sampler("rest-weights").result()
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(trainer.training_run_id).result()
    by_path = {c.path: c for c in listed.checkpoints}
    assert (
        by_path[state.path].checkpoint_type == "training"
        and by_path[weights.path].checkpoint_type == "sampler"
    )
    run = rest.get_training_run(trainer.training_run_id).result()
    assert run.training_run_id == trainer.training_run_id and run.lora_rank == 4 and run.is_lora
    assert trainer.training_run_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    ]
    session = rest.get_session(service.service_session_cuid).result()
    assert trainer.training_run_id in session.training_run_ids
    assert service.service_session_cuid in rest.list_sessions(limit=100).result().sessions
    sampler = service.create_sampling_client(
        model_path=weights.path
    )  # base model resolved from the checkpoint
    assert rest.get_sampler(sampler.sampling_run_id).result().model_path == weights.path

    ck = by_path[weights.path].checkpoint_id
    result = rest.download_checkpoint(ck, tmp_path / "weights.tar").result()
    assert result.file_size_bytes == (tmp_path / "weights.tar").stat().st_size > 0
    again = rest.download_checkpoint(
        ck, tmp_path / "weights.tar"
    ).result()  # already complete: resumed, 0 bytes
    assert again.resumed and again.bytes_written == 0 and again.file_size_bytes == result.file_size_bytes
    rest.delete_checkpoint(trainer.training_run_id, ck).result()
    assert weights.path not in {
        c.path for c in rest.list_checkpoints(trainer.training_run_id).result().checkpoints
    }


def test_service_client_reads_the_environment_and_refuses_a_bad_key(server, monkeypatch):
    monkeypatch.setenv("TRINE_BASE_URL", server.url + "/api/")
    monkeypatch.setenv("TRINE_API_KEY", server.api_key)
    with trio.ServiceClient() as svc:
        assert MODEL in [m.alias for m in svc.get_server_capabilities().supported_models]
        info = svc.create_lora_training_client(MODEL, rank=4, seed=9).get_info()
        assert info.lora_config.rank == 4 and info.base_model == MODEL
    with pytest.raises(trio.AuthError):
        trio.ServiceClient(api_key="trine-wrong", base_url=server.url)
    monkeypatch.delenv("TRINE_API_KEY")
    monkeypatch.delenv("TRINE_BASE_URL")
    monkeypatch.setenv("PYTRIO_BASE_URL", server.url)
    monkeypatch.setenv("PYTRIO_API_KEY", server.api_key)
    with trio.ServiceClient() as svc:  # a PyTRIO environment pointed at trine works as is
        assert svc.base_url == server.url
    monkeypatch.delenv("PYTRIO_API_KEY")
    with pytest.raises(trio.AuthError, match="TRINE_API_KEY"):
        trio.ServiceClient()
    monkeypatch.setattr("trine.client.service._configured", {})
    trio.configure(api_key=server.api_key, retry_window_s=5.0)
    with trio.ServiceClient() as svc:
        assert svc._rt.settings.retry_window_s == 5.0
    with pytest.raises(ValueError, match="unknown option"):
        trio.configure(retry_windw_s=1)


def test_training_client_uses_torch_free_types(service):
    """Tensors from the server come back as TensorData convertible to torch and numpy."""
    trainer = service.create_lora_training_client(MODEL, rank=4)
    out = trainer.forward(
        [
            trio.Datum(
                model_input=trio.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]}
            )
        ]
    ).result()
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.dtype == "float32" and lp.to_numpy().shape == (3,) and lp.to_torch().dtype == torch.float32


class LoseFirstResponse(httpx.AsyncBaseTransport):
    """The network, losing the response to the first request whose path contains `part`: the
    server did the work, the client saw a read timeout (and must retry with the same id)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, part: str):
        self.inner, self.part, self.lost = inner, part, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.part in request.url.path and not self.lost:
            await response.aread()
            self.lost.append(request.content)
            raise httpx.ReadTimeout("the response was lost", request=request)
        return response


def test_lost_responses_are_retried_with_the_same_ids_and_run_once(server, tokenizer):
    batch = [sft_datum(tokenizer, "Retries must not train twice.")]
    adam = trio.AdamParams(learning_rate=2e-2)
    with trio.ServiceClient(
        api_key=server.api_key, base_url=server.url, settings=trio.Settings(retry_initial_delay_s=0.05)
    ) as svc:
        clean = svc.create_lora_training_client(MODEL, rank=4, seed=8)
        expected = [clean.forward_backward(batch), clean.optim_step(adam), clean.forward_backward(batch)]
        expected = [f.result() for f in expected]

        flaky = svc.create_lora_training_client(MODEL, rank=4, seed=8)
        flaky.forward(batch).result()  # init_run and one event go through untouched
        http = svc._rt.actor_http
        http._transport = LoseFirstResponse(http._transport, "/v1/events")
        got = [flaky.forward_backward(batch), flaky.optim_step(adam), flaky.forward_backward(batch)]
        got = [f.result(timeout=60) for f in got]
        assert len(http._transport.lost) == 1
        # bit for bit: the retried calls ran once, the same computation in the same order
        assert got[2].metrics["loss_sum"] == expected[2].metrics["loss_sum"]

        sampler = svc.create_sampling_client(base_model=MODEL)
        http._transport = LoseFirstResponse(http._transport.inner, "/sample")
        res = sampler.sample(
            trio.ModelInput.from_ints([1, 2, 3]),
            num_samples=2,
            sampling_params=trio.SamplingParams(max_tokens=3, seed=1),
        ).result(timeout=60)
        assert len(http._transport.lost) == 1 and len(res.sequences) == 2
        key = server.service.authenticate(server.api_key)
        ops = [e.operation for e in server.service.usage_events(key, run_id=flaky.training_run_id)]
        assert sorted(ops) == ["forward", "forward_backward", "forward_backward", "optim_step"]
        recorded = server.service.usage_events(key, run_id=sampler.sampling_run_id)
        assert len(recorded) == 1 and recorded[0].sample == res.usage.sample_tokens


def test_closing_the_service_fails_pending_futures_instead_of_hanging(server, tokenizer):
    svc = trio.ServiceClient(api_key=server.api_key, base_url=server.url)
    trainer = svc.create_lora_training_client(MODEL, rank=4)
    batch = [sft_datum(tokenizer, "closing while work is pending")]
    pending = [trainer.forward_backward(batch) for _ in range(4)]
    svc.close()
    for f in pending:
        try:
            f.result(timeout=30)  # finished before the close, or failed by it
        except trio.TrineError as e:  # the server ended the session's runs, or the client stopped
            assert e.code in ("run_ended", "client_closed")
    with pytest.raises(trio.TrineError, match="closed"):
        trainer.optim_step(trio.AdamParams())


def test_trine_checkpoints_lists_what_a_run_saved(server, service, tokenizer):
    from click.testing import CliRunner

    from trine.cli.checkpoints import checkpoints

    trainer = service.create_lora_training_client(MODEL, rank=4)
    trainer.forward_backward([sft_datum(tokenizer, "checkpoint me")]).result()
    saved = trainer.save_weights_for_sampler("listed-weights").result()
    out = CliRunner().invoke(checkpoints, ["--home", str(server.home), "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["uri"]: r for r in json.loads(out.stdout)}
    assert rows[saved.path]["size_bytes"] > 0 and rows[saved.path]["visibility"] == "WORKSPACE"
    text = CliRunner().invoke(checkpoints, ["--home", str(server.home)]).stdout
    assert saved.path in text and re.search(r"\d+(\.\d+)? [KMG]B", text)  # a size for people


def test_the_session_trace_downloads_from_the_sdk(server, service, tmp_path):
    """RestClient.download_session_trace writes the session's trace; export_session_trace signs a
    URL that serves the same trace without the key (server/traces.py)."""
    sampler = service.create_sampling_client(base_model=MODEL)
    prompt = trio.ModelInput.from_ints(list(range(1, 20)))
    sampler.sample(prompt, sampling_params=trio.SamplingParams(max_tokens=3, temperature=0.0)).result()
    rest = service.create_rest_client()
    sid = service.service_session_cuid
    path = rest.download_session_trace(sid, tmp_path / "t" / "trace.json").result()
    trace = json.loads(path.read_text())
    decode = [e for e in trace["traceEvents"] if e.get("cat") == "decode"]
    assert decode and decode[-1]["args"]["tokens"] == {"sample": 3}
    url = rest.export_session_trace(sid).result()
    signed = httpx.get(url, trust_env=False).json()
    assert [e for e in signed["traceEvents"] if e.get("cat") == "decode"][-1] == decode[-1]
    with pytest.raises(trio.TrineError, match="not found"):
        rest.download_session_trace("ss_nope", tmp_path / "x.json").result()


def test_the_sdks_own_async_calls_answer_as_their_sync_twins(server, service, tmp_path):
    """The four calls trine adds to PyTRIO's API have `_async` forms (as every PyTRIO call does) for
    loops that run in asyncio: they answer what the sync call's future does."""
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=3)
    rest = service.create_rest_client()
    sid = service.service_session_cuid
    prompt = trio.ModelInput.from_ints(list(range(1, 12)))
    params = trio.SamplingParams(max_tokens=3, temperature=0.0)

    async def calls():
        logged = await trainer.log_metrics_async({"reward": 0.25}, step=1)
        inflight = await trainer.inflight_sampling_client_async()
        sampled = await inflight.sample_async(prompt, sampling_params=params)
        url = await rest.export_session_trace_async(sid)
        path = await rest.download_session_trace_async(sid, tmp_path / "trace.json")
        return logged, sampled, url, path

    logged, sampled, url, path = asyncio.run(calls())
    assert logged == trainer.log_metrics({"reward": 0.25}, step=1).result()  # the same step replaces
    seq = sampled.sequences[0]
    assert seq.weights_versions == [1] * 3  # an inflight sampler: the version of its first save
    sync = trainer.inflight_sampling_client().sample(prompt, sampling_params=params).result()
    assert sync.sequences[0].tokens == seq.tokens
    assert "traceEvents" in json.loads(path.read_text())
    assert "traceEvents" in httpx.get(url, trust_env=False).json()


def test_pytrios_async_twins_answer_as_their_sync_twins(server, service, tokenizer, tmp_path):
    """Every `_async` call of PyTRIO's official 0.2.9 API that trine's own code never calls (the
    ServiceClient's, the TrainingClient's checkpoint and custom-loss calls, the RestClient's): code
    ported from PyTRIO awaits them, so each must answer what its sync twin's future does."""
    batch = [sft_datum(tokenizer, "Async twins answer as sync ones.")]
    prompt = trio.ModelInput.from_ints(list(range(1, 9)))
    params = trio.SamplingParams(max_tokens=2, temperature=0.0)
    rest = service.create_rest_client()
    sid = service.service_session_cuid

    def nll(data, logprobs):
        return -sum(lp.sum() for lp in logprobs), {}

    async def service_and_training():
        caps = await service.get_server_capabilities_async()
        trainer = await service.create_lora_training_client_async(base_model=MODEL, rank=4, seed=11)
        custom = await (await trainer.forward_backward_custom_async(batch, nll))
        await trainer.optim_step_async(trio.AdamParams(learning_rate=1e-2))
        state = await (await trainer.save_state_async("twins-state"))
        weights = await (await trainer.save_weights_for_sampler_async("twins-weights"))
        sampler = await trainer.create_sampling_client_async(weights.path)
        base_sampler = await service.create_sampling_client_async(base_model=MODEL)
        restored = await service.create_training_client_from_state_async(state.path)
        with_optim = await service.create_training_client_from_state_with_optimizer_async(state.path)
        loaded = await service.create_lora_training_client_async(base_model=MODEL, rank=4, seed=11)
        await (await loaded.load_state_async(state.path))
        loaded_optim = await service.create_lora_training_client_async(base_model=MODEL, rank=4, seed=11)
        await (await loaded_optim.load_state_with_optimizer_async(state.path))
        return (
            caps,
            trainer,
            custom,
            state,
            weights,
            sampler,
            base_sampler,
            (restored, with_optim, loaded, loaded_optim),
        )

    caps, trainer, custom, state, weights, sampler, base_sampler, restored = asyncio.run(
        service_and_training()
    )
    assert caps == service.get_server_capabilities()
    twin = service.create_lora_training_client(base_model=MODEL, rank=4, seed=11)
    assert twin.forward_backward_custom(batch, nll).result().loss_fn_outputs[0]["logprobs"].tolist() == (
        custom.loss_fn_outputs[0]["logprobs"].tolist()
    )
    greedy = sampler.sample(prompt, sampling_params=params).result().sequences[0].tokens
    assert (
        trainer.create_sampling_client(weights.path)
        .sample(prompt, sampling_params=params)
        .result()
        .sequences[0]
        .tokens
        == greedy
    )
    assert base_sampler.sample(prompt, sampling_params=params).result().sequences[0].tokens == (
        service.create_sampling_client(base_model=MODEL)
        .sample(prompt, sampling_params=params)
        .result()
        .sequences[0]
        .tokens
    )
    # every restored client holds the saved weights: the same forward as the saving run, bit for bit
    want = trainer.forward(batch).result().metrics["loss_sum"]
    for t in restored:
        assert t.forward(batch).result().metrics["loss_sum"] == want

    run_id, ckpt = trainer.training_run_id, None

    async def rest_calls():
        nonlocal ckpt
        got = {
            "run": await rest.get_training_run_async(run_id),
            "runs": await rest.list_training_runs_async(limit=100),
            "checkpoints": await rest.list_checkpoints_async(run_id),
            "user_checkpoints": await rest.list_user_checkpoints_async(limit=100),
            "session": await rest.get_session_async(sid),
            "sessions": await rest.list_sessions_async(limit=100),
            "sampler": await rest.get_sampler_async(sampler.sampling_run_id),
        }
        ckpt = got["checkpoints"].checkpoints[0].checkpoint_id
        got["archive"] = (await rest.get_checkpoint_archive_url_async(ckpt)).url is not None
        got["download"] = await rest.download_checkpoint_async(ckpt, tmp_path / "async.tar")
        return got

    got = asyncio.run(rest_calls())
    assert got["run"] == rest.get_training_run(run_id).result()
    assert got["runs"] == rest.list_training_runs(limit=100).result()
    assert got["checkpoints"] == rest.list_checkpoints(run_id).result()
    assert got["user_checkpoints"] == rest.list_user_checkpoints(limit=100).result()
    assert got["session"] == rest.get_session(sid).result()
    assert got["sessions"] == rest.list_sessions(limit=100).result()
    assert got["sampler"] == rest.get_sampler(sampler.sampling_run_id).result()
    sync = rest.download_checkpoint(ckpt, tmp_path / "sync.tar").result()
    assert got["archive"] and got["download"].bytes_written == sync.bytes_written > 0
    assert (tmp_path / "async.tar").read_bytes() == (tmp_path / "sync.tar").read_bytes()
    asyncio.run(rest.delete_checkpoint_async(run_id, ckpt))
    assert ckpt not in [c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints]
