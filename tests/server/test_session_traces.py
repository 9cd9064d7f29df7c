"""Session traces (issue 30 item 3) through the official, unmodified `tinker` 0.38 client against a
real server: `export_session_trace` polls the server, gets a signed URL, and the URL serves (with
no key) a Chrome trace-event JSON of every sampling request and training event of the session,
with token counts and cost on each span that add up to the session's metered usage."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]
PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token cache blocks


@pytest.fixture(scope="module")
def session(srv):
    """A session that trained two steps and sampled three requests: (client, session id)."""
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:-1]),
        loss_fn_inputs={"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)},
    )
    for _ in range(2):
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        fb.result(), opt.result()
    sampler = sc.create_sampling_client(base_model=MODEL).result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=2)
    futures = [sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params) for _ in range(3)]
    for f in futures:
        f.result()
    yield sc, sc.holder.get_session_id()
    sc.close("success").result()


def rest(url: str, key: str) -> "tinker.RestClient":
    return tinker.RestClient(base_url=url, api_key="tml-" + key)


def download(url: str) -> dict:
    r = httpx.get(url, trust_env=False)  # no key: the URL carries its own token
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()


def spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_export_session_trace_through_the_official_client(srv, session):
    sc, sid = session
    url = rest(srv.url, srv.api_key).export_session_trace(sid).result()
    assert f"/session-traces/{sid}?token=" in url
    trace = download(url)
    xs = spans(trace)
    by_lane = defaultdict(list)
    for e in xs:
        by_lane[e["cat"]].append(e)
        assert e["dur"] >= 0 and "tokens" in e["args"] and "cost" in e["args"]
    assert set(by_lane) == {"queue", "prefill", "decode", "cycle", "train"}
    assert len(by_lane["prefill"]) == len(by_lane["decode"]) == 3
    # every training event that ran: init, then 2 x (forward_backward, optim_step); its queue span
    # ends where its cycle starts, and its step lies inside that cycle
    steps = [e["args"]["event_type"] for e in by_lane["train"]]
    assert sorted(steps) == sorted(["init_run"] + ["forward_backward", "optimize_step"] * 2)
    cycles = {e["args"]["cycle"]: e for e in by_lane["cycle"]}
    for e in by_lane["train"]:
        c = cycles[e["args"]["cycle"]]
        assert c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 1  # 1 us of rounding
    # tokens and cost add up to the session's metering
    key = srv.service.store.key_by_secret(srv.api_key)
    usage = srv.service.usage_events(key, session_id=sid)
    for lane, phase in (("prefill", "prefill"), ("prefill", "prefill_cached"), ("decode", "sample")):
        assert sum(e["args"]["tokens"][phase] for e in by_lane[lane]) == sum(getattr(u, phase) for u in usage)
    assert sum(e["args"]["tokens"]["train"] for e in by_lane["train"]) == sum(u.train for u in usage) > 0
    assert sum(e["args"]["tokens"]["sample"] for e in by_lane["decode"]) == 3 * 2 * 5
    spent = sum(e["args"]["cost"] for lane in ("prefill", "decode", "train") for e in by_lane[lane])
    # each span's cost is a few fp64 products and sums of token counts and per-million prices (the
    # card's prices make them multiples of 1e-8, which the trace's 9 decimals keep): spent and the
    # metered total are a few dozen correctly rounded fp64 operations apart, ~1e-15 relative
    assert spent == pytest.approx(
        sum(srv.service.rate_card.cost(u)["total"] for u in usage), rel=1e-12, abs=0
    )
    assert spent > 0
    # spans on one thread never overlap (Perfetto then needs no nesting rules), and every thread and
    # process is named
    named = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    rows = defaultdict(list)
    for e in xs:
        rows[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert set(rows) <= named
    for row in rows.values():
        row.sort()
        # a span may end where the next starts; ts (epoch us, ~1.8e15) and ts + dur are each rounded
        # once in fp64 (half an ulp of ts, 0.125 us), and ts and dur to 3 decimals where that is finer
        assert all(a[1] <= b[0] + 2 * math.ulp(b[0]) + 1.5e-3 for a, b in zip(row, row[1:]))
    assert any(e["name"] == "process_name" and "replica 0" in e["args"]["name"] for e in trace["traceEvents"])


def test_the_signed_url_serves_only_its_session_until_it_expires(srv, session):
    sc, sid = session
    url = rest(srv.url, srv.api_key).export_session_trace(sid).result()
    base, token = url.split("?token=")
    assert httpx.get(base, trust_env=False).status_code == 401  # no token
    assert httpx.get(f"{base}?token={token[:-2]}xx", trust_env=False).status_code == 401
    other = base.replace(sid, "ss_other")
    assert httpx.get(f"{other}?token={token}", trust_env=False).status_code == 404
    key = srv.service.store.key_by_secret(srv.api_key)
    signer = srv._server.config.app.state.signer
    old, _ = signer.issue(key_id=key.id, subject=sid, kind="trace", ttl=-10)
    r = httpx.get(f"{base}?token={old}", trust_env=False)
    assert r.status_code == 401 and r.json()["code"] == "token_expired"
    # a download token for a checkpoint is not a trace token
    ck, _ = signer.issue(key_id=key.id, subject=sid, kind="download")
    assert httpx.get(f"{base}?token={ck}", trust_env=False).status_code == 401


def test_another_key_cannot_export_the_session(srv, session):
    _, sid = session
    other = srv.service.ownership.create_key("other")
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + other)
    try:
        with pytest.raises(tinker.NotFoundError):
            rest(srv.url, other).export_session_trace(sid).result()
        r = httpx.get(
            f"{srv.url}/api/trine/v1/sessions/{sid}/trace", headers={"X-API-Key": other}, trust_env=False
        )
        assert r.status_code == 404
    finally:
        sc.close("success").result()


def test_trine_routes_serve_the_same_trace_and_the_timeline(srv, session):
    _, sid = session
    h = {"X-API-Key": srv.api_key}
    r = httpx.get(f"{srv.url}/api/trine/v1/sessions/{sid}/trace", headers=h, trust_env=False)
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    signed = httpx.get(f"{srv.url}/api/trine/v1/sessions/{sid}/trace-url", headers=h, trust_env=False).json()
    assert spans(download(signed["url"])) == spans(r.json()) and signed["expires"]
    tl = httpx.get(f"{srv.url}/api/trine/v1/sessions/{sid}/timeline", headers=h, trust_env=False).json()
    assert tl["session_id"] == sid and tl["seconds"] > 0
    assert min(s["start"] for s in tl["spans"]) == 0
    assert {s["lane"] for s in tl["spans"]} == {"queue", "prefill", "decode", "cycle", "train"}


def test_the_tinker_cli_downloads_the_trace(srv, session, tmp_path, monkeypatch):
    """`tinker session export-trace SID -o FILE`: the official CLI polls, then downloads the URL."""
    from click.testing import CliRunner
    from tinker.cli.__main__ import main_cli

    _, sid = session
    monkeypatch.setenv("TINKER_BASE_URL", srv.url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-" + srv.api_key)
    out = tmp_path / "session.pftrace"
    res = CliRunner().invoke(main_cli, ["session", "export-trace", sid, "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert spans(json.loads(out.read_text()))
