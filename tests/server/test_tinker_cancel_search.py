"""cancel_future and search_sessions through the official `tinker` 0.38 client against a real trine
server: a long sample cancelled from the client stops in the engine (its KV blocks freed), its
future reports cancelled, and the tokens it produced are metered; sessions are found by name, tag
and metadata."""

from __future__ import annotations

import asyncio
import time

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
LONG = 3000  # tokens: far longer than the test waits


def on_loop(srv, coro):
    return asyncio.run_coroutine_threadsafe(coro, srv.service.loop).result()


def sampler_stats(srv) -> dict:
    rep = srv.service.models[MODEL].replicas[0]
    return on_loop(srv, rep.engine.stats()).sampler


def wait_for(check, what: str, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_cancelling_a_long_sample_frees_its_kv_and_meters_what_it_produced(srv, sc):
    sampler = sc.create_sampling_client(base_model=MODEL).result()
    params = types.SamplingParams(max_tokens=LONG, temperature=1.0, seed=1, stop=[])  # no EOS stop
    prompt = types.ModelInput.from_ints([1, 504, 3330, 314, 253])
    sampled_before = sampler_stats(srv)["sample_tokens"]
    fut = sampler.sample(prompt, num_samples=1, sampling_params=params)
    running = wait_for(
        lambda: (s := sampler_stats(srv))["running"] == 1 and s["sample_tokens"] > sampled_before + 20 and s,
        "the sample to run",
    )
    assert running["blocks_used"] > 0

    assert fut.future().cancel()
    assert fut.future().cancelled()  # the client's future reports cancelled at once
    with pytest.raises(Exception) as caught:
        fut.result()
    assert type(caught.value).__name__ == "CancelledError"

    # the client's cancel_future reaches the server: the engine stops and frees the request's KV
    after = wait_for(lambda: (s := sampler_stats(srv))["running"] == 0 and s, "the engine to stop it")
    assert after["blocks_used"] == 0 and after["waiting"] == 0

    svc = srv.service
    key = svc.store.key_by_secret(srv.api_key)
    (run,) = svc.store.sampling_runs(key.id)  # the Tinker sampling session
    (event,) = wait_for(lambda: svc.queries.usage_events(key, run_id=run.id), "the usage event")
    assert event.prefill + event.prefill_cached == 5  # its prompt
    produced = after["sample_tokens"] - sampled_before
    assert 20 < event.sample < LONG and abs(event.sample - produced) <= 1  # the tokens it sampled

    # the session goes on: the next sample of the same client runs to its end
    done = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, seed=2))
    assert len(done.result().sequences[0].tokens) == 4


def test_cancel_future_of_an_unknown_or_finished_request_is_a_no_op(srv, sc):
    import httpx

    headers = {"X-API-Key": "tml-" + srv.api_key}
    for rid in ("nope:1", "tk-x-1", "x"):
        r = httpx.post(f"{srv.url}/api/v1/cancel_future", json={"request_id": rid}, headers=headers)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{srv.url}/api/v1/client/dynamic_config", json={}, headers=headers)
    assert r.json()["sample_cancel_enabled"] is True


def test_search_sessions_by_name_tags_metadata_and_status(srv, monkeypatch):
    secret = "tml-" + srv.service.ownership.create_key("searcher")  # a key of its own: only these sessions

    def session(name, meta, tags=None):
        if tags:
            monkeypatch.setenv("TINKER_TAGS", tags)
        else:
            monkeypatch.delenv("TINKER_TAGS", raising=False)
        c = tinker.ServiceClient(user_metadata=meta, display_name=name, base_url=srv.url, api_key=secret)
        return c, c.holder.get_session_id()

    (_, sft), (rl_client, rl), (_, adhoc) = (
        session("Nightly SFT qwen", {"team": "rl", "lr": "1e-4"}, tags="nightly,sft"),
        session("nightly RL run", {"team": "rl"}, tags="nightly"),
        session("adhoc", {"team": "infra"}),
    )
    rl_client.close("errored").result()
    rest = tinker.RestClient(base_url=srv.url, api_key=secret)

    def ids(**kw) -> list[str]:
        page = rest.search_sessions(types.SessionSearchRequest(**kw)).result()
        return [s.session_id for s in page.sessions]

    assert ids() == [adhoc, rl, sft]  # newest first
    assert ids(display_name="NIGHTLY") == [rl, sft]  # case-insensitive substring
    assert ids(display_name="nightly qwen") == [sft]  # every word somewhere in the name
    assert ids(display_name="qwen", session_id=adhoc) == [adhoc, sft]  # either one
    assert ids(user_metadata={"team": "rl"}) == [rl, sft]  # exact pairs, all of them
    assert ids(user_metadata={"team": "rl", "lr": "1e-4"}) == [sft]
    assert ids(user_metadata={"team": "r"}) == []
    assert ids(user_metadata={"tags": "nightly"}) == [rl, sft]  # tags: each must be held
    assert ids(user_metadata={"tags": "sft,nightly"}) == [sft]
    assert ids(statuses=[types.ActiveSessionStatusQuery()]) == [adhoc, sft]
    assert ids(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])]) == [rl]
    assert ids(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])]) == []

    summary = rest.search_sessions(types.SessionSearchRequest(session_id=rl)).result().sessions[0]
    assert summary.display_name == "nightly RL run" and summary.owner == "searcher"
    assert summary.user_metadata == {"team": "rl", "name": "nightly RL run", "tags": "nightly"}
    assert summary.status.type == "client_finished" and summary.status.reason.type == "errored"
    assert summary.checkpoints_count == 0

    first = rest.search_sessions(types.SessionSearchRequest(limit=2)).result()  # pages follow the cursor
    assert [s.session_id for s in first.sessions] == [adhoc, rl] and first.next_cursor is not None
    second = rest.search_sessions(types.SessionSearchRequest(limit=2, cursor=first.next_cursor)).result()
    assert [s.session_id for s in second.sessions] == [sft] and second.next_cursor is None

    with pytest.raises(tinker.BadRequestError, match="project_ids: trine has no projects"):
        rest.search_sessions(types.SessionSearchRequest(project_ids=["p"])).result()
