"""Your own weights in, in full out, through the trine SDK and CLI against a real server: a PEFT
adapter imported with `lora_path=` or `trine adapters import` (checked before anything is stored,
recorded with its source) and trained on; `full=True` fine-tuning over the PyTRIO wire."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from serverutil import serve
from tolerance import assert_served_paths

import trine as trio
from trine.cli.main import main
from trine.errors import ControlAPIError

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("weights-home")
    old = os.environ.get("TRINE_HOME")
    os.environ["TRINE_HOME"] = str(home)
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
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """An adapter trained elsewhere: peft's own (random, non-zero B), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("peft") / "my-adapter"
    model.save_pretrained(out)
    return out


def datum(tokens=TEXT) -> trio.Datum:
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def prompt_logprobs(sampler) -> list:
    return sampler.compute_logprobs(trio.ModelInput.from_ints(TEXT)).result()


def test_lora_path_imports_the_adapter_and_trains_from_it_recording_its_source(server, service, adapter_dir):
    trainer = service.create_lora_training_client(MODEL, lora_path=adapter_dir)
    store = server.service.store
    run = store.training_run(trainer.training_run_id)
    imported = store.checkpoint_by_uri(run.source_checkpoint_uri)  # its lineage: the import
    assert imported.kind == "SAMPLER" and imported.lora_rank == 4 and imported.name == "my-adapter"
    assert "uploaded as my-adapter" in imported.source and "sha256" in imported.source
    assert store.training_run(imported.training_run_id).tag_list == ["imported"]  # listed as a run

    base = prompt_logprobs(service.create_sampling_client(base_model=MODEL))
    start = prompt_logprobs(trainer.save_weights_and_get_sampling_client())
    assert max(abs(a - b) for a, b in zip(start[1:], base[1:])) > 1e-2  # the imported adapter is on
    assert start == prompt_logprobs(service.create_sampling_client(model_path=imported.uri))  # kind 1
    trainer.forward_backward([datum()], "cross_entropy")
    trainer.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert prompt_logprobs(trainer.save_weights_and_get_sampling_client()) != start  # it trains on

    listed = service.create_rest_client().list_checkpoints(imported.training_run_id).result().checkpoints
    assert [(c.path, c.source) for c in listed] == [(imported.uri, imported.source)]


def test_a_mismatched_adapter_is_refused_naming_the_tensor_and_leaves_nothing(
    server, service, adapter_dir, tmp_path
):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    state[key] = torch.zeros(4, 255)
    save_file(state, str(bad / "adapter_model.safetensors"))
    store = server.service.store
    api_key = store.key_by_secret(server.api_key)
    before = (store.checkpoints(api_key.id)[1], store.training_runs(api_key.id)[1])
    with pytest.raises(
        ControlAPIError, match=rf"{key} has shape \(4, 255\); the base model needs \(4, 256\)"
    ):
        service.create_lora_training_client(MODEL, lora_path=bad)
    assert (store.checkpoints(api_key.id)[1], store.training_runs(api_key.id)[1]) == before


def test_trine_adapters_import_uploads_through_the_same_route(server, adapter_dir):
    r = CliRunner().invoke(
        main,
        ["adapters", "import", str(adapter_dir), "--base-model", MODEL, "--url", server.url, "--json"],
        env={"TRINE_API_KEY": server.api_key},
    )
    assert r.exit_code == 0, r.output
    ck = json.loads(r.output)
    assert ck["checkpoint_uri"].endswith("/weights/my-adapter") and ck["checkpoint_type"] == "SAMPLER"
    assert "uploaded as my-adapter" in ck["source"]
    refused = CliRunner().invoke(
        main,
        ["adapters", "import", str(adapter_dir), "--base-model", "Qwen3-8B", "--url", server.url],
        env={"TRINE_API_KEY": server.api_key},
    )
    assert refused.exit_code != 0 and "is not served here" in refused.output


def test_full_true_fine_tunes_every_weight_over_the_pytrio_wire(server, service):
    trainer = service.create_lora_training_client(MODEL, full=True, trainable_token_indices=[504, 3330])
    run = server.service.store.training_run(trainer.training_run_id)
    assert run.lora_rank == 0 and json.loads(run.trainable_token_indices) == [504, 3330]
    for _ in range(2):
        trainer.forward_backward([datum()], "cross_entropy")
        trainer.optim_step(trio.AdamParams(learning_rate=1e-3))
    trained = trainer.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert_served_paths(prompt_logprobs(trainer.save_weights_and_get_sampling_client())[1:], trained)
    saved = trainer.save_state("full-state").result()
    again = service.create_training_client_from_state_with_optimizer(saved.path)
    assert again.lora.full and again.lora.trainable_token_indices == [504, 3330]
    assert server.service.store.training_run(again.training_run_id).lora_rank == 0
    with pytest.raises(Exception, match="only full fine-tuning"):
        service.create_lora_training_client(MODEL, rank=8, trainable_token_indices=[1])


def test_lora_path_follows_symlinks_as_a_hugging_face_snapshot_holds_them(
    server, service, adapter_dir, tmp_path
):
    """A snapshot in the Hugging Face cache links its files into blobs/: the SDK uploads the files
    the links name (the route reads regular files only, and once read 'adapter_config.json is
    missing')."""
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (snap / f).symlink_to(adapter_dir / f)
    trainer = service.create_lora_training_client(MODEL, lora_path=snap)
    assert server.service.store.training_run(trainer.training_run_id).lora_rank == 4


def upload(server, body: bytes, name: str):
    import httpx

    return httpx.post(
        f"{server.url}/api/trine/v1/adapters",
        params={"base_model": MODEL, "name": name},
        content=body,
        headers={"X-API-Key": server.api_key},
        timeout=60,
    )


def tar_of(files: dict[str, bytes], mode: str = "w") -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_truncated_or_bomb_archive_is_a_400_naming_the_body(server, adapter_dir, monkeypatch):
    """A truncated tar or gzip stream, and an archive that unpacks past the upload bound (refused
    from the member's header, before it is unpacked), are 400s naming the body, never a 500."""
    from trine.server.pytrio import routes_adapters

    files = {f: (adapter_dir / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}
    for mode in ("w", "w:gz"):
        whole = tar_of(files, mode)
        r = upload(server, whole[: len(whole) // 2], "cut")
        assert r.status_code == 400 and r.json()["code"] == "invalid_request_body", r.text
        assert r.json()["message"].startswith("body: the tar archive is truncated or corrupt")
    monkeypatch.setattr(routes_adapters, "MAX_ADAPTER_UPLOAD_BYTES", 1 << 20)
    bomb = tar_of({"adapter_model.safetensors": bytes(4 << 20)}, "w:gz")  # 4 MiB of zeros
    assert len(bomb) < 64 << 10
    r = upload(server, bomb, "bomb")
    assert r.status_code == 400, r.text
    assert (
        f"unpacks to more than {1 << 20} bytes (at its member 'adapter_model.safetensors')"
        in r.json()["message"]
    )
    assert not list((server.service.store.home / "imports").glob("*/*"))  # nothing left unpacked


def test_an_adapter_that_computes_nan_or_inf_is_refused_and_leaves_nothing(server, adapter_dir, tmp_path):
    """NaN in a tensor, a scale that overflows (rsLoRA's lora_alpha x sqrt(r)) and a config nested
    too deeply to parse are each a 400 naming the file and the field; nothing is stored."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    nan_file = tmp_path / "nan.safetensors"
    save_file({**state, key: torch.full_like(state[key], float("nan"))}, str(nan_file))
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    cases = [
        (json.dumps(cfg).encode(), nan_file.read_bytes(), f"tensor {key} holds NaN or infinite values"),
        (
            json.dumps({**cfg, "lora_alpha": 1e308, "use_rslora": True}).encode(),
            weights,
            "lora_alpha makes the scale inf",
        ),
        (b"[" * 100_000 + b"]" * 100_000, weights, "adapter_config.json is nested too deeply to parse"),
    ]
    store = server.service.store
    api_key = store.key_by_secret(server.api_key)
    before = (store.checkpoints(api_key.id)[1], store.training_runs(api_key.id)[1])
    for i, (config, tensors, words) in enumerate(cases):
        r = upload(
            server, tar_of({"adapter_config.json": config, "adapter_model.safetensors": tensors}), f"x{i}"
        )
        assert r.status_code == 400 and r.json()["code"] == "adapter_invalid", r.text
        assert words in r.json()["message"], r.json()["message"]
    assert (store.checkpoints(api_key.id)[1], store.training_runs(api_key.id)[1]) == before
