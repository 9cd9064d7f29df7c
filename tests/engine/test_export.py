"""Adapters that load elsewhere: `trine export` (PEFT adapter or merged model) and downloads into a
directory."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_losses import randomize
from tolerance import Rounding, fp64_adapter, fp64_model

from trine.cli.main import main
from trine.engine.api import LoRAConfig
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.weights import load_model
from trine.engine.trainer.trainer import Trainer

TOKENS = torch.tensor([[5, 900, 17, 4000, 23, 8, 49000, 3, 77, 1200]])


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """A trine model and a saved sampler checkpoint adapting attention, MLP and the (tied) unembedding."""
    model = load_model(tiny_model_dir, "cpu")
    assert model.cfg.tie_word_embeddings
    trainer = Trainer(model, base_model="tiny-llama")
    trainer.create_run("r", LoRAConfig(rank=8, alpha=16.0))
    randomize(trainer.adapter("r"), 1)
    path = tmp_path_factory.mktemp("ck") / "weights"
    trainer.save_weights("r", path)
    model64 = fp64_model(tiny_model_dir)
    with torch.no_grad():
        want = model(TOKENS, adapters=AdapterBatch.single(trainer.adapter("r")))
        base = model(TOKENS)
        want64 = model64(TOKENS, adapters=AdapterBatch.single(fp64_adapter(trainer.adapter("r"), model64)))
    return path, want, base, want64


def assert_like_trines(got, want, want64):
    """Kind 3, against fp64: trine's fp32 logits with the adapter are the reference, the exported
    model's (merged weights, or PEFT's own LoRA) the path: the same math, in other orders (a merged
    weight rounds W + s B A once more). transformers cannot run it in fp64 (it normalises and
    rotates in fp32 in any dtype), so the fp64 value is trine's fp64 model with the adapter."""
    Rounding(want, want64).assert_within(got)


def hf_logits(path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(TOKENS).logits


def test_merged_export_gives_trines_adapter_logits_with_tied_embeddings_untied(
    saved, tiny_model_dir, tmp_path
):
    path, want, base, want64 = saved
    out = tmp_path / "merged"
    r = CliRunner().invoke(main, ["export", str(path), str(out), "--merged"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    got = hf_logits(out)
    assert (want - base).abs().max() > 1e-2  # the adapter (unembedding included) matters
    assert_like_trines(got, want, want64)
    # the untied input embeddings are still the base model's
    from safetensors.torch import load_file

    merged, orig = (
        load_file(str(out / "model.safetensors")),
        load_file(str(tiny_model_dir / "model.safetensors")),
    )
    assert torch.equal(merged["model.embed_tokens.weight"], orig["model.embed_tokens.weight"])
    # a second export into the same (now non-empty) directory is refused, not mixed in
    again = CliRunner().invoke(main, ["export", str(path), str(out), "--merged"])
    assert again.exit_code != 0 and "not an empty directory" in again.output


def test_adapter_export_loads_with_peft_from_its_own_config(saved, tmp_path):
    from peft import AutoPeftModelForCausalLM

    path, want, _, want64 = saved
    out = tmp_path / "adapter"
    r = CliRunner().invoke(main, ["export", str(path), str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "trine_checkpoint.json",
    ]
    m = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert_like_trines(m(TOKENS).logits, want, want64)


def peft_config_keys() -> set[str]:
    """Every key PEFT's own LoraConfig writes (its dataclass fields)."""
    import dataclasses

    from peft import LoraConfig

    return {f.name for f in dataclasses.fields(LoraConfig)}


def test_exported_adapter_config_has_only_pefts_keys_and_trines_facts_apart(saved, tmp_path):
    path, *_ = saved
    out = tmp_path / "adapter"
    assert CliRunner().invoke(main, ["export", str(path), str(out)]).exit_code == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert set(cfg) <= peft_config_keys(), set(cfg) - peft_config_keys()
    facts = json.loads((out / "trine_checkpoint.json").read_text())
    assert facts["base_model"] == "tiny-llama" and facts["exported_from"] == str(path)


def test_exported_files_are_readable_by_all_and_writable_by_the_owner(saved, tiny_model_dir, tmp_path):
    """safetensors writes 0600 and a base model's files may be read-only or private: exports are 0644."""
    import shutil
    import stat

    path, *_ = saved
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    for f in base.iterdir():
        f.chmod(0o400 if f.suffix == ".json" else 0o600)
    for args, out in ((["--merged", "--base", str(base)], tmp_path / "merged"), ([], tmp_path / "adapter")):
        r = CliRunner().invoke(main, ["export", str(path), str(out), *args])
        assert r.exit_code == 0, r.output
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
        assert "model.safetensors" in modes or "adapter_model.safetensors" in modes
        assert set(modes.values()) == {0o644}, modes
    assert "trine_merged_from" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert json.loads((tmp_path / "merged" / "trine_checkpoint.json").read_text())["merged_from"] == str(path)


def test_export_refuses_unknown_checkpoint(tmp_path):
    r = CliRunner().invoke(main, ["export", "trio://nope", str(tmp_path / "o"), "--home", str(tmp_path)])
    assert r.exit_code == 2 and "trine checkpoints" in r.output
    (tmp_path / "not-a-checkpoint").mkdir()
    r = CliRunner().invoke(main, ["export", str(tmp_path / "not-a-checkpoint"), str(tmp_path / "o")])
    assert r.exit_code == 1 and "is not a LoRA checkpoint" in r.output and not (tmp_path / "o").exists()


def test_download_checkpoint_into_a_directory_extracts_a_peft_adapter(tiny_model_dir, tmp_path):
    from serverutil import serve

    import trine as trio

    with (
        serve(tiny_model_dir, tmp_path / "home") as srv,
        trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service,
    ):
        trainer = service.create_lora_training_client("tiny-llama", rank=4)
        saved = trainer.save_weights_for_sampler("exported").result()
        rest = service.create_rest_client()
        ck = next(
            c
            for c in rest.list_checkpoints(trainer.training_run_id).result().checkpoints
            if c.path == saved.path
        )
        target = tmp_path / "adapter"
        target.mkdir()
        result = rest.download_checkpoint(ck.checkpoint_id, target).result()
        assert result.path == str(target)
        assert sorted(p.name for p in target.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "trine_checkpoint.json",
        ]
        cfg = json.loads((target / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())
        assert json.loads((target / "trine_checkpoint.json").read_text())["base_model"] == "tiny-llama"
        # a file name still gets the archive itself
        tar = rest.download_checkpoint(ck.checkpoint_id, tmp_path / "ck.tar").result()
        assert tar.file_size_bytes == (tmp_path / "ck.tar").stat().st_size > 0
