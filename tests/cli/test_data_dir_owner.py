"""A data dir has one owner (issue 51, item 1): an exclusive OS lock held for the owner's life.

A second `trine serve`, a `trine keys` writer or a migration on an owned dir fails at once (exit 2)
naming the owner's pid, host and port; readers (`trine usage`, `trine keys list`, `trine
checkpoints`) keep working beside it; after kill -9 of the owner a restart takes the lock with no
manual step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from serverutil import free_port, run_serve_cli, wait_http

from trine.store import DataDirInUse, Store
from trine.store.owner import LOCK_FILE, claim

TRINE = [sys.executable, "-m", "trine.cli.main"]


def trine(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*TRINE, *args], capture_output=True, text=True, timeout=timeout)


def hold_in_another_process(home, host="127.0.0.1", port=18901) -> subprocess.Popen:
    """A process that owns `home` (as a server would, naming its address) until killed."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from trine.store import Store
        store = Store({str(home)!r})
        store.claim.announce(command="trine serve", host={host!r}, port={port})
        print("owned", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "owned"
    return proc


def test_a_second_process_is_refused_naming_the_owner_and_a_kill_frees_it(tmp_path):
    Store(tmp_path).close()
    owner = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(DataDirInUse) as e:
            Store(tmp_path)  # the migration a writer runs is refused with it
        message = str(e.value)
        assert f"pid {owner.pid}" in message and socket.gethostname() in message, message
        assert "127.0.0.1:18901" in message and "\n" not in message
        reader = Store(tmp_path, read_only=True)  # readers claim nothing
        assert reader.keys() == []
        reader.close()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    store = Store(tmp_path)  # the kernel dropped the dead owner's lock: nothing to clean up
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    store.close()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean exit names no owner


def test_claims_of_one_process_share_the_lock_until_the_last_is_released(tmp_path):
    first = Store(tmp_path)
    second = Store(tmp_path)
    first.close()
    probe = [sys.executable, "-c", f"from trine.store import Store; Store({str(tmp_path)!r}).close()"]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # `second` still holds it
    second.close()
    assert subprocess.run(probe, capture_output=True).returncode == 0
    Store(tmp_path)  # never closed, collected at once: its claim goes with it
    assert subprocess.run(probe, capture_output=True).returncode == 0
    held = claim(tmp_path, command="trine keys")
    assert subprocess.run(probe, capture_output=True).returncode != 0
    held.release()
    assert held.released


def test_read_only_store_reads_an_older_schema_without_migrating(tmp_path):
    import sqlite3

    Store(tmp_path).create_key("a")
    db = sqlite3.connect(tmp_path / "trine.db")
    db.execute("ALTER TABLE api_keys DROP COLUMN revoked_at")  # as an older trine wrote it
    db.commit()
    db.close()
    reader = Store(tmp_path, read_only=True)
    (key,) = reader.keys()
    assert key.name == "a" and key.revoked_at is None
    with pytest.raises(sqlite3.OperationalError):
        reader.create_key("b")  # a reader never writes
    reader.close()
    cols = {r[1] for r in sqlite3.connect(tmp_path / "trine.db").execute("PRAGMA table_info(api_keys)")}
    assert "revoked_at" not in cols  # no migration happened


def test_writers_are_refused_and_readers_work_beside_an_owner(tmp_path):
    created = trine("keys", "create", "--name", "first", "--home", str(tmp_path))
    assert created.returncode == 0, created.stderr
    owner = hold_in_another_process(tmp_path, port=18902)
    try:
        writers = (
            ["keys", "create", "--name", "x"],
            ["keys", "revoke", "key_nope"],
            ["demo", "--model", str(tmp_path)],
        )
        for args in writers:
            r = trine(*args, "--home", str(tmp_path))
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            line = r.stderr.strip()
            assert len(line.splitlines()) == 1 and "Traceback" not in line, line
            assert f"pid {owner.pid}" in line and "127.0.0.1:18902" in line, line
        listed = trine("keys", "list", "--home", str(tmp_path), "--json")
        assert listed.returncode == 0, listed.stderr
        assert [k["name"] for k in json.loads(listed.stdout)] == ["first"]
        usage = trine("usage", "--home", str(tmp_path), "--json")
        assert usage.returncode == 0, usage.stderr
        ckpts = trine("checkpoints", "--home", str(tmp_path), "--json")
        assert ckpts.returncode == 0 and json.loads(ckpts.stdout) == [], ckpts.stderr
    finally:
        owner.kill()
        owner.wait(10)


def serve_args(model_dir, home, port) -> list[str]:
    return ["--model", str(model_dir), "--port", str(port), "--home", str(home), "--threads", "1"]


def test_a_second_serve_fails_at_once_and_kill_9_then_restart_takes_the_lock(tiny_model_dir, tmp_path):
    port, other = free_port(), free_port()
    proc, text, key = run_serve_cli(serve_args(tiny_model_dir, tmp_path, port))
    restarted = None
    try:
        assert key, text
        assert wait_http(f"http://127.0.0.1:{port}/health", key).status_code == 200
        begun = time.monotonic()
        second = trine("serve", *serve_args(tiny_model_dir, tmp_path, other))
        assert second.returncode == 2, (second.stdout, second.stderr)
        line = (second.stdout + second.stderr).strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line, line
        assert f"pid {proc.pid}" in line and socket.gethostname() in line, line
        assert f"127.0.0.1:{port}" in line and str(tmp_path) in line, line
        assert time.monotonic() - begun < 30  # at once: no model was loaded
        assert trine("usage", "--home", str(tmp_path)).returncode == 0  # a reader beside it
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        restarted, text, _ = run_serve_cli(serve_args(tiny_model_dir, tmp_path, other))
        assert "PYTRIO_API_KEY=" in text, text  # no manual step: the stale lock file is taken over
        assert wait_http(f"http://127.0.0.1:{other}/health", key).status_code == 200  # same data dir
        owner = json.loads((tmp_path / LOCK_FILE).read_text())
        assert owner["pid"] == restarted.pid and owner["port"] == other
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_an_embedded_server_owns_its_data_dir_and_names_its_port(tiny_model_dir, tmp_path):
    from serverutil import serve

    with serve(tiny_model_dir, tmp_path) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        owner = json.loads((tmp_path / LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["port"] == port, owner
        r = trine("keys", "create", "--name", "x", "--home", str(tmp_path))
        assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr, r.stderr
    assert (tmp_path / LOCK_FILE).read_text() == ""  # stopped: released
    assert trine("keys", "create", "--name", "x", "--home", str(tmp_path)).returncode == 0
