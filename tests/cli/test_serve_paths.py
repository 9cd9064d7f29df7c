"""A wrong path is one line, not a traceback (issue 51, item 3): `trine serve --home FILE`, a data
dir or checkpoint dir that cannot be created or written, `--model FILE`. Each names the path and
what is wrong with it, and exits 2, before anything is loaded."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner
from serverutil import free_port

from trine.cli import datadir
from trine.cli.main import main


def serve(*args: str):
    return CliRunner().invoke(main, ["serve", "--port", str(free_port()), *args])


def one_line(r, *needles: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    text = r.output.strip()
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def test_home_that_is_a_regular_file(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    home.write_text("not a dir")
    one_line(serve("--home", str(home)), f"--home {home}", "is a file, not a directory")
    one_line(serve("--home", str(home), "--model", str(tiny_model_dir)), str(home), "is a file")


def test_home_below_a_regular_file(tmp_path, tiny_model_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    home = blocker / "home"
    one_line(
        serve("--home", str(home), "--model", str(tiny_model_dir)),
        f"--home {home}",
        f"{blocker} is a file",
    )


@pytest.fixture
def read_only_mount(monkeypatch, tmp_path):
    """`tmp_path / "ro"` behaves as a read-only mount: creating a file in it fails with EROFS (a
    real read-only mount needs privileges; as root, chmod makes nothing unwritable)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = datadir.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kw):
        if dir is not None and os.path.realpath(dir).startswith(str(ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kw)

    monkeypatch.setattr(datadir.tempfile, "mkstemp", mkstemp)
    return ro


def test_home_on_a_read_only_mount(read_only_mount, tiny_model_dir):
    one_line(
        serve("--home", str(read_only_mount), "--model", str(tiny_model_dir)),
        f"--home {read_only_mount}",
        "cannot write there (read-only file system)",
    )


def test_checkpoint_dir_on_a_read_only_mount(tmp_path, read_only_mount, tiny_model_dir):
    ckpts = read_only_mount / "ckpts"
    ckpts.mkdir()
    home = str(tmp_path / "home")
    r = serve("--home", home, "--model", str(tiny_model_dir), "--checkpoint-dir", str(ckpts))
    one_line(r, f"--checkpoint-dir {ckpts}", "read-only file system")
    assert not (tmp_path / "home" / "trine.db").exists()  # refused before anything was set up


def test_checkpoint_dir_that_is_a_file_or_below_one(tmp_path, tiny_model_dir):
    f = tmp_path / "ckpt-file"
    f.write_text("x")
    home = str(tmp_path / "home")
    one_line(
        serve("--home", home, "--model", str(tiny_model_dir), "--checkpoint-dir", str(f)),
        f"--checkpoint-dir {f}",
        "is a file, not a directory",
    )
    one_line(
        serve("--home", home, "--model", str(tiny_model_dir), "--checkpoint-dir", str(f / "sub")),
        f"--checkpoint-dir {f / 'sub'}",
        f"{f} is a file",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode bits")
def test_home_without_write_permission(tmp_path, tiny_model_dir):
    home = tmp_path / "locked"
    home.mkdir()
    home.chmod(0o500)
    try:
        one_line(serve("--home", str(home), "--model", str(tiny_model_dir)), f"--home {home}", "cannot write")
    finally:
        home.chmod(0o700)


def test_model_that_is_a_file(tmp_path):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"\0" * 8)
    one_line(
        serve("--home", str(tmp_path / "home"), "--model", str(model)),
        f"--model {model}",
        "is a file, not a model directory",
    )
    one_line(
        serve("--home", str(tmp_path / "home"), "--model", f"mine={model}"),
        f"--model mine={model}",
        "is a file",
    )


def test_model_that_does_not_exist_or_has_no_config(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    home = str(tmp_path / "home")
    one_line(serve("--home", home, "--model", str(tmp_path / "nope")), "no such directory")
    one_line(serve("--home", home, "--model", str(empty)), str(empty), "no config.json")


def test_keys_writers_name_a_data_dir_that_is_a_file(tmp_path):
    home = tmp_path / "home"
    home.write_text("x")
    for args in (["keys", "create", "--name", "k"], ["keys", "revoke", "key_x"]):
        one_line(CliRunner().invoke(main, [*args, "--home", str(home)]), f"--home {home}", "is a file")
    one_line(CliRunner().invoke(main, ["keys", "list", "--home", str(home)]), f"--home {home}", "is a file")
