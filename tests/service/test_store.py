"""The SQLite store: keys are hashed, rows round-trip, data survives reopening, usage is filtered."""

from __future__ import annotations

import sqlite3
import time

from trine.metering.events import CacheDiagnostic, UsageEvent
from trine.store import Checkpoint, EventRecord, Session, Store, TrainingRun, hash_key


def test_keys_are_hashed_and_verified(tmp_path):
    store = Store(tmp_path)
    rec, secret = store.create_key("alice")
    assert secret.startswith("trine-") and len(secret) > 40
    assert store.key_by_secret(secret).id == rec.id
    assert store.key_by_secret(secret + "x") is None
    raw = sqlite3.connect(tmp_path / "trine.db").execute("SELECT key_hash FROM api_keys").fetchall()
    assert raw == [(hash_key(secret),)] and secret not in str(raw)  # only the hash is stored
    store.revoke_key(rec.id)
    assert store.key_by_secret(secret) is None


def test_rows_round_trip_and_survive_reopen(tmp_path):
    store = Store(tmp_path)
    key, _ = store.create_key("k")
    now = time.time()
    store.add_session(Session("ss_1", key.id, "ACTIVE", "0.2.9", now, now))
    store.add_training_run(
        TrainingRun(
            "tr_1", key.id, "ss_1", 1, "tiny", 8, True, False, True, None, "", False, "ACTIVE", now, now
        )
    )
    store.add_event(EventRecord("event_1", "tr_1", key.id, 1, "trainer.init_run", 0, "accepted", now, now))
    store.update_event("event_1", status="succeeded", cycle=3, response=b"\x81\xa1a\x01")
    store.add_checkpoint(
        Checkpoint(
            "ck_1",
            key.id,
            "tr_1",
            "s1",
            "TRAINING",
            "trio://tr_1/state/s1",
            str(tmp_path / "x"),
            123,
            "WORKSPACE",
            "tiny",
            8,
            True,
            False,
            True,
            None,
            2,
            now,
        )
    )
    store.close()

    store = Store(tmp_path)
    run = store.training_run("tr_1")
    assert run.train_mlp is True and run.train_attn is False and run.seed is None
    ev = store.event("event_1")
    assert (ev.status, ev.cycle, ev.response) == ("succeeded", 3, b"\x81\xa1a\x01")
    assert store.checkpoint_by_uri("trio://tr_1/state/s1").size_bytes == 123
    assert store.max_cycle() == 3
    assert store.unfinished_events() == []


def test_usage_and_diagnostics_are_filtered_by_key_session_run_and_time(tmp_path):
    store = Store(tmp_path)
    events = [
        UsageEvent(100.0, "k1", "s1", "r1", "m", "sample", prefill=5, prefill_cached=3, sample=7),
        UsageEvent(200.0, "k1", "s2", "r2", "m", "forward_backward", train=10, train_loss=4),
        UsageEvent(300.0, "k2", "s3", "r3", "m", "sample", sample=1),
    ]
    for e in events:
        store.add_usage(e)
    assert store.usage_events("k1") == events[:2]
    assert store.usage_events("k1", session_id="s2") == [events[1]]
    assert store.usage_events("k1", run_id="r1") == [events[0]]
    assert store.usage_events("k1", since=150.0) == [events[1]]
    assert store.usage_events("k3") == []
    d = CacheDiagnostic(1.0, "k1", "s1", "r1", "m", "varying_head", 4, 40, "req")
    store.add_diagnostic(d)
    assert store.diagnostics("k1") == [d] and store.diagnostics("k2") == []


def test_sample_results_are_kept_per_sampling_run(tmp_path):
    store = Store(tmp_path)
    store.add_sample_result("sr_1", "req_1", b'{"a": 1}')
    assert store.sample_result("sr_1", "req_1") == (b'{"a": 1}', "")
    assert store.sample_result("sr_2", "req_1") is None
