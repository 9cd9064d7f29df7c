"""The official, unmodified `tinker` 0.38.0 client against a real trine server on a tiny model.

The server returns the model directory as `tokenizer_id`, so `get_tokenizer()` loads offline; the
key is trine's key in its `tml-` form; telemetry is off.

Float comparisons (tests/tolerance.py): what the server must move intact is bit for bit (kind 1: a
stored checkpoint's weights are its fp32 values, so a reload computes the same thing in the same
order); a metric that is the sum of values reported beside it is within that sum's a priori bound
(kind 2); two engine paths of the same math (sampler vs trainer, a cached last-n prefill vs a whole
one, a datum batched with others vs alone) are within SERVED_PATHS, the rounding tests/engine bounds.
"""

from __future__ import annotations

import http.server
import threading

import httpx
import numpy as np
import pytest
from serverutil import serve, tinker_env
from tolerance import EPS32, SERVED_PATHS, assert_served_paths, assert_sum_of

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]
PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token cache blocks and 8 more


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    with tinker_env(), serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as handle:
        yield handle


def client(url: str, key: str) -> "tinker.ServiceClient":
    return tinker.ServiceClient(base_url=url, api_key="tml-" + key)


@pytest.fixture(scope="module")
def sc(srv):
    c = client(srv.url, srv.api_key)
    yield c
    c.close("success").result()


def datum(tokens=TEXT, weights=None):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * (len(tokens) - 1)},
    )


def logprobs(out) -> np.ndarray:
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def usage(srv, **filters):
    key = srv.service.store.key_by_secret(srv.api_key)
    return srv.service.usage_events(key, **filters)


def test_sft_loss_falls_over_pipelined_steps_with_summed_losses(sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    assert tc.get_info().model_data.tokenizer_id.endswith(MODEL)
    assert len(tc.get_tokenizer()) == 49152  # offline, from the served model directory
    data = [datum(), datum(TEXT[2:])]
    losses, cycles = [], []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")  # submitted before waiting: pipelined
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out, _ = fb.result(), opt.result()
        assert len(out.loss_fn_outputs) == 2
        # Tinker sums per-token losses: loss:sum is -sum(logprobs) for weights 1 (kind 2: the engine
        # adds the reported fp32 values, -1 * logp exactly, in fp64)
        assert_sum_of(out.metrics["loss:sum"], -logprobs(out))
        losses.append(out.metrics["loss:sum"])
        cycles.append(out.metrics["clock_cycle:unique"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    assert len(set(cycles)) == len(cycles)  # one clock cycle per pipelined step


def test_group_of_eight_prefills_once_and_reports_cache_hits(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    first = sampler.sample(types.ModelInput.from_ints(PROMPT), 8, params).result()
    second = sampler.sample(types.ModelInput.from_ints(PROMPT), 8, params).result()
    assert len(first.sequences) == 8 and all(len(s.tokens) == 4 for s in first.sequences)
    assert len({s.sequence_id for s in first.sequences + second.sequences}) == 16
    events = [e for e in usage(srv) if e.operation == "sample"][-2:]
    assert [e.prefill + e.prefill_cached for e in events] == [len(PROMPT)] * 2  # once per group, not 8x
    assert first.prompt_cache_hit_tokens == events[0].prefill_cached == 0
    # two full blocks and 7 tokens of a first sample's partial last block: all but the last token
    assert second.prompt_cache_hit_tokens == events[1].prefill_cached == 39


def test_compute_logprobs_equals_the_trainers_logprobs(sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = logprobs(tc.forward([datum()], "cross_entropy").result())
    sampled = (
        tc.save_weights_and_get_sampling_client()
        .result()
        .compute_logprobs(types.ModelInput.from_ints(TEXT))
        .result()
    )
    assert sampled[0] is None
    assert_served_paths(sampled[1:], trained)  # the sampler's prefill vs the trainer's forward


def test_saved_state_loads_into_a_new_client_with_identical_losses(sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    for _ in range(2):
        tc.forward_backward([datum()], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
    path = tc.save_state("two-steps").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/two-steps")
    tc2 = sc.create_training_client_from_state_with_optimizer(path).result()
    for _ in range(2):  # the optimizer state came along: further steps stay identical
        a = [
            tc.forward_backward([datum()], "cross_entropy"),
            tc.optim_step(types.AdamParams(learning_rate=1e-2)),
        ]
        b = [
            tc2.forward_backward([datum()], "cross_entropy"),
            tc2.optim_step(types.AdamParams(learning_rate=1e-2)),
        ]
        # the two runs' datums may share one trainer call (packed rows, other GEMM shapes) or not: two
        # paths; loss:sum adds n logprobs, so n times their scale
        out_a, out_b = a[0].result(), b[0].result()
        assert_served_paths(
            out_a.metrics["loss:sum"],
            out_b.metrics["loss:sum"],
            scale=(len(TEXT) - 1) * float(np.abs(logprobs(out_b)).max()),
        )
        a[1].result(), b[1].result()


def test_named_sampler_weights_are_saved_listed_and_sampled(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=4).result()
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("final").result().path
    assert path.endswith("/sampler_weights/final")
    sampler = sc.create_sampling_client(model_path=path).result()
    live = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TEXT)
    # kind 1: the saved file holds the live adapter's fp32 values; compute_logprobs never reads the cache
    assert sampler.compute_logprobs(prompt).result() == live.compute_logprobs(prompt).result()
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, stop=[])).result()
    assert all(len(s.tokens) == 3 and len(s.logprobs) == 3 for s in out.sequences)
    rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    run_id = path.split("/")[2]
    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert path in {c.tinker_path for c in listed}
    rest.delete_checkpoint(run_id, "sampler_weights/final").result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_a_second_key_cannot_see_the_first_keys_runs_or_checkpoints(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    path = tc.save_weights_for_sampler("mine").result().path
    run_id = path.split("/")[2]
    _, other_key = srv.service.store.create_key("other")
    other = client(srv.url, other_key)
    try:
        rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + other_key)
        assert rest.list_training_runs().result().training_runs == []
        with pytest.raises(Exception, match="not found"):
            rest.list_checkpoints(run_id).result()
        with pytest.raises(Exception, match="not found"):
            other.create_sampling_client(model_path=path).result().sample(
                types.ModelInput.from_ints(TEXT), 1, types.SamplingParams(max_tokens=1)
            ).result()
        model_id = tc.get_info().model_id
        r = httpx.post(
            f"{srv.url}/api/v1/get_info",
            json={"model_id": model_id},
            headers={"X-API-Key": "tml-" + other_key},
        )
        assert r.status_code == 404
    finally:
        other.close("success").result()
    bad = httpx.post(f"{srv.url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-trine-nope"})
    assert bad.status_code == 401


class _LossyProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the server; answers the first forward_backward with a 503 after
    the server has accepted it (a response lost on the way back)."""

    def __init__(self, target: str):
        self.target, self.dropped, self.forward_backward_posts = target, 0, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                r = httpx.request(
                    self.command, proxy.target + self.path, content=body, headers=headers, timeout=60
                )
                if self.path == "/api/v1/forward_backward":
                    proxy.forward_backward_posts += 1
                    if proxy.dropped == 0:
                        proxy.dropped = 1
                        self.send_response(503)
                        self.send_header("content-length", "0")
                        self.end_headers()
                        return
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "content-encoding",
                    ):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_DELETE = do_PUT = _relay

        super().__init__(("127.0.0.1", 0), Handler)


def test_a_lost_response_is_retried_and_runs_once(srv):
    proxy = _LossyProxy(srv.url)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    _, key = srv.service.store.create_key("lossy")
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    c = client(url, key)
    try:
        tc = c.create_lora_training_client(base_model=MODEL, rank=4).result()
        out = tc.forward_backward([datum()], "cross_entropy").result()
        assert proxy.dropped == 1 and proxy.forward_backward_posts == 2  # sent twice
        run_id = (
            tinker.RestClient(base_url=url, api_key="tml-" + key)
            .list_training_runs()
            .result()
            .training_runs[0]
            .training_run_id
        )
        runs = [
            e
            for e in srv.service.usage_events(srv.service.store.key_by_secret(key), run_id=run_id)
            if e.operation == "forward_backward"
        ]
        assert len(runs) == 1 and runs[0].train == len(TEXT) - 1  # ran once
        assert out.metrics["loss:sum"] > 0
    finally:
        c.close("success").result()
        proxy.shutdown()
        proxy.server_close()


def test_stable_reinforce_trains_on_the_recorded_sampler_logprobs(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = TEXT[:6]
    seq = (
        sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4))
        .result()
        .sequences[0]
    )
    tokens = prompt + list(seq.tokens)
    n = len(tokens) - 1
    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n,  # ignored: recorded
            "advantages": [0.0] * (len(prompt) - 1) + [1.0] * 4,
        },
    )

    def provenance(sid):
        return d.with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                types.SampledProvenanceSpan(sequence_id=sid, length=3),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                types.SampledProvenanceSpan(sequence_id=sid, length=4),
            ],
        )

    out = tc.forward_backward([provenance(seq.sequence_id)], "stable_reinforce").result()
    # on-policy: the weight min(exp(logp - q), 2) is 1 up to the trainer's and the sampler's rounding
    # (two paths), so the loss is -sum(w * A * logp) over the sampled tokens: the reported values'
    # sum (kind 2) with w from them, each term rounded by the engine's fp32 exp and two products
    lp = logprobs(out)[-4:].astype(np.float64)
    assert_served_paths(lp, seq.logprobs)
    w = np.minimum(np.exp(lp - np.asarray(seq.logprobs, dtype=np.float64)), 2.0)
    assert_sum_of(out.metrics["loss:sum"], -w * lp, term_rel=2 * EPS32)
    with pytest.raises(Exception, match="stability record"):
        tc.forward_backward([provenance("nope")], "stable_reinforce").result()


def test_gspo_and_usage_of_tinker_traffic(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=6).result()
    n = len(TEXT) - 1
    lp = logprobs(tc.forward([datum()], "cross_entropy").result())
    d = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:-1]),
        loss_fn_inputs={
            "target_tokens": TEXT[1:],
            "logprobs": lp.tolist(),
            "advantages": [1.0] * n,
            "sequence_ratio_mask": [0.0] * 4 + [1.0] * (n - 4),
        },
    )
    out = tc.forward_backward([d], "gspo").result()
    # on-policy: every token's ratio is exp(M), M the mean of logp - q with q this forward's logp: a
    # forward and a forward_backward are two paths (M within SERVED_PATHS of lp's scale), so the
    # loss -n * exp(M) is -n within n * (that + the exp's and the sum's rounding)
    assert abs(out.metrics["loss:sum"] + n) <= n * (SERVED_PATHS * float(np.abs(lp).max()) + 2 * EPS32)
    rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    run_id = rest.get_training_run(tc.get_info().model_id).result().training_run_id  # model ids work too
    assert [e.operation for e in usage(srv, run_id=run_id)] == ["forward", "forward_backward"]
    sampler = tc.save_weights_and_get_sampling_client().result()
    for _ in range(2):  # the second group hits the cache
        sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=2)).result()
    admin = tinker.AdminClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    billing = admin.get_billing_usage("2020-01-01T00:00:00Z", "2100-01-01T00:00:00Z").result().data
    kinds = {(e.event_info.type, getattr(e.event_info, "cached", None)) for e in billing}
    assert {
        ("training", None),
        ("sampling_prefill", False),
        ("sampling_prefill", True),
        ("sampling_sample", None),
    } <= kinds
    assert all(e.estimated_cost_usd is not None and e.bucket_end > e.bucket_start for e in billing)
    trained = sum(e.event_info.token_count for e in billing if e.event_info.type == "training")
    assert trained == sum(e.train for e in usage(srv))  # answered from trine's metering


def test_bad_input_fails_its_future_and_the_client_goes_on(sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    out_of_vocab = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10**6]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(Exception, match="outside the vocabulary"):
        tc.forward_backward([out_of_vocab], "cross_entropy").result()
    with pytest.raises(Exception, match="not supported"):
        tc.forward_backward([datum()], "mse").result()
    # the refused calls kept their places: the next ones run
    assert tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_every_key_has_a_tml_form_that_is_the_same_key(tmp_path):
    from trine.store import Store
    from trine.store.keys import tinker_form

    store = Store(tmp_path)
    try:
        rec, secret = store.create_key("k")
        assert tinker_form(secret) == "tml-" + secret
        assert store.key_by_secret(tinker_form(secret)).id == store.key_by_secret(secret).id == rec.id
        other = "y" if secret.endswith("x") else "x"  # a secret may end in "x" (1 in 64)
        assert store.key_by_secret("tml-" + secret[:-1] + other) is None
        assert store.key_by_secret(secret[len("trine-") :]) is None  # the prefix is not optional
        store.revoke_key(rec.id)
        assert store.key_by_secret(tinker_form(secret)) is None
    finally:
        store.close()


def test_retrieve_future_long_polls_then_answers_try_again(srv, monkeypatch):
    import asyncio

    from trine.server.tinker import futures
    from trine.server.tinker.state import state_of

    monkeypatch.setattr(futures, "LONG_POLL_SECONDS", 0.2)
    key = srv.service.store.key_by_secret(srv.api_key)
    table = state_of(type("R", (), {"app": srv._server.config.app})()).futures
    release = asyncio.Event()

    async def work():
        await release.wait()
        return futures.Reply.json({"done": True})

    async def start():
        table.start(key.id, "tk-slow", work)

    asyncio.run_coroutine_threadsafe(start(), srv.service.loop).result()
    headers = {"X-API-Key": "tml-" + srv.api_key}
    poll = lambda rid: httpx.post(
        f"{srv.url}/api/v1/retrieve_future",
        json={"request_id": rid},  # noqa: E731
        headers=headers,
    )
    r = poll("tk-slow")
    assert r.status_code == 408 and r.json() == {
        "type": "try_again",
        "request_id": "tk-slow",
        "queue_state": "active",
    }
    srv.service.loop.call_soon_threadsafe(release.set)
    assert poll("tk-slow").json() == {"done": True}
    assert poll("tk-unknown").status_code == 410  # never submitted (or forgotten): the SDK resubmits
    other = {"X-API-Key": "tml-" + srv.service.store.create_key("o")[1]}
    assert (
        httpx.post(
            f"{srv.url}/api/v1/retrieve_future", json={"request_id": "tk-slow"}, headers=other
        ).status_code
        == 410
    )  # another key's future does not exist for it


def test_weights_only_restore_prompt_logprobs_and_rest_routes(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("w").result().path
    before = tc.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
    fresh = sc.create_training_client_from_state(path).result()  # weights only: a new optimizer
    # kind 1: the same fp32 weights, the same datum alone in its call: the same computation
    assert fresh.forward([datum()], "cross_entropy").result().metrics["loss:sum"] == before
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints(TEXT),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(TEXT)
    assert out.topk_prompt_logprobs[0] is None or out.topk_prompt_logprobs[0] == []
    for lp, top in zip(out.prompt_logprobs[1:], out.topk_prompt_logprobs[1:]):
        # kind 1: the token's logprob and the top 3 are entries of one log-softmax row
        assert len(top) == 3 and top[0][1] >= lp and top[0][1] >= top[1][1] >= top[2][1]
    last = sampler.compute_logprobs(types.ModelInput.from_ints(TEXT), prompt_logprobs_last_n=4).result()
    assert last[:-4] == [None] * (len(TEXT) - 4)
    assert_served_paths(last[-4:], out.prompt_logprobs[-4:])  # last-n on cached blocks vs a whole prefill
    rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    run_id = path.split("/")[2]
    run = rest.get_training_run(run_id).result()
    assert run.training_run_id == run_id and run.lora_rank == 4 and run.last_checkpoint.tinker_path == path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == MODEL and info.lora_rank == 4 and info.is_lora
    headers = {"X-API-Key": "tml-" + srv.api_key}
    assert httpx.post(f"{srv.url}/api/v1/telemetry", json={"events": []}, headers=headers).json() == {
        "status": "accepted"
    }
    sid = httpx.post(f"{srv.url}/api/v1/create_session", json={"sdk_version": "t"}, headers=headers).json()[
        "session_id"
    ]
    beat = lambda: httpx.post(
        f"{srv.url}/api/v1/session_heartbeat",
        json={"session_id": sid},  # noqa: E731
        headers=headers,
    )
    assert beat().json() == {"type": "session_heartbeat"}
    httpx.post(
        f"{srv.url}/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}, headers=headers
    )
    assert beat().status_code == 410  # a finished session: the SDK stops its heartbeat loop


def test_custom_loss_and_legacy_load_state(srv, sc):
    import torch

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=8).result()

    def mean_nll(data, logprobs_list):  # runs on the client; the server gets a linearised cross_entropy
        loss = -torch.stack([lp.mean() for lp in logprobs_list]).mean()
        return loss, {"custom:mean": float(loss.detach())}

    out = tc.forward_backward_custom([datum(), datum(TEXT[3:])], mean_nll).result()
    alone = [logprobs(tc.forward([d], "cross_entropy").result()) for d in (datum(), datum(TEXT[3:]))]
    expected = -np.mean([lp.astype(np.float64).mean() for lp in alone])
    # two datums in one call vs each alone (two paths); a mean of means moves by at most the
    # logprobs' own error, so their scale
    assert_served_paths(out.metrics["loss:sum"], expected, scale=max(float(np.abs(lp).max()) for lp in alone))
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("custom").result().path
    later = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still sent: the legacy load_weights form
        later.load_state_with_optimizer(path).result()
    # kind 1: the state's fp32 weights, the same datum alone in its call
    assert (
        later.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
        == tc.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
    )


def test_raw_protobuf_bodies_zstd_and_garbage(srv, sc):
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    model_id = tc.get_info().model_id
    headers = {"X-API-Key": "tml-" + srv.api_key, "Content-Type": "application/x-protobuf"}
    req = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(data=[datum()], loss_fn="cross_entropy"),
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(req).SerializeToString())
    r = httpx.post(
        f"{srv.url}/api/v1/forward_backward", content=body, headers={**headers, "Content-Encoding": "zstd"}
    )
    assert r.status_code == 200 and r.json()["request_id"].endswith("-1")
    for bad, encoding, what in (
        (b"\xff\xfe garbage", "identity", "ForwardBackwardRequest"),
        (body, "identity", "ForwardBackwardRequest"),  # compressed, undeclared
        (b"not zstd", "zstd", "zstd"),
        (body, "br", "Content-Encoding"),
    ):
        r = httpx.post(
            f"{srv.url}/api/v1/forward_backward",
            content=bad,
            headers={**headers, "Content-Encoding": encoding},
        )
        assert r.status_code == 400 and what in r.json()["message"], r.text


def test_checkpoints_are_shared_with_the_pytrio_front_end(srv, sc):
    import trine as trio

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=9).result()
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("shared").result().path
    uri = path.replace("tinker://", "trio://").replace("/sampler_weights/", "/weights/")
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc:
        theirs = (
            svc.create_sampling_client(model_path=uri)
            .compute_logprobs(trio.ModelInput.from_ints(TEXT))
            .result()
        )
    ours = (
        sc.create_sampling_client(model_path=path)
        .result()
        .compute_logprobs(types.ModelInput.from_ints(TEXT))
        .result()
    )
    assert theirs == ours  # kind 1: one checkpoint, one computation, through either front end
