"""Every change of service state happens on the event loop thread: control-plane routes hammered
from many threads at once never write from another thread, and run numbering stays consistent."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverutil import RawClient, event, init_payload, serve

MODEL = "tiny-llama"
WRITES = ("add_", "update_", "delete_", "create_")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def test_control_plane_state_changes_all_run_on_the_loop(server, monkeypatch):
    store = server.service.store
    writers: collections.Counter = collections.Counter()
    for name in dir(store):
        if name.startswith(WRITES) and callable(getattr(store, name)):
            original = getattr(store, name)

            def spy(*a, _original=original, _name=name, **kw):
                writers[(_name, threading.current_thread().name)] += 1
                return _original(*a, **kw)

            monkeypatch.setattr(store, name, spy)

    c0 = RawClient(server.url, server.api_key)
    run = c0.training_run(c0.session(), MODEL)
    rid = run["training_run_cuid"]
    c0.submit(run, event(f"event_ham{rid[-6:]}1", "init_run", 1, init_payload(run["model_id"]), rid))
    c0.wait(run, f"event_ham{rid[-6:]}1")
    for i in range(2, 8):
        c0.submit(run, event(f"event_ham{rid[-6:]}{i}", "save_weights", i, {"name": f"ck{i}"}, rid))
    checkpoints = [
        c0.wait(run, f"event_ham{rid[-6:]}{i}")["result"]["checkpoint"]["checkpoint_cuid"]
        for i in range(2, 8)
    ]

    def worker(n: int) -> list[int]:
        c = RawClient(server.url, server.api_key)
        try:
            statuses = []
            session = c.session()
            for _ in range(3):
                r = c.control(
                    "POST",
                    f"service-sessions/{session}/training-runs",
                    json={"base_model": MODEL, "lora_rank": 4},
                )
                statuses.append(r.status_code)
                statuses.append(
                    c.control(
                        "POST", f"service-sessions/{session}/sampling-runs", json={"base_model": MODEL}
                    ).status_code
                )
                statuses.append(c.control("GET", "checkpoints").status_code)
            if n < len(checkpoints):
                statuses.append(c.control("DELETE", f"checkpoints/{checkpoints[n]}").status_code)
            statuses.append(c.control("POST", f"service-sessions/{session}/close", json={}).status_code)
            return statuses
        finally:
            c.close()

    with ThreadPoolExecutor(12) as pool:
        statuses = [s for out in pool.map(worker, range(12)) for s in out]
    c0.close()
    assert statuses and all(s == 200 for s in statuses), collections.Counter(statuses)
    threads = {thread for (_, thread) in writers}
    assert threads == {"trine-server"}, writers  # uvicorn's loop runs in the server thread
    key_id = store.key_by_secret(server.api_key).id
    runs, total = store.training_runs(key_id)
    assert total == 1 + 12 * 3
    numbers = [(r.session_id, r.run_index) for r in runs + store.sampling_runs(key_id)]
    assert len(numbers) == len(set(numbers)) == 1 + 12 * 6  # run numbering: unique within a session
