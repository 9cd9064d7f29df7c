"""Adapters that load elsewhere: `trine export` (PEFT adapter or merged model) and downloads into a directory."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from trine.cli.main import main
from trine.engine.lora import AdapterBatch, LoRAConfig
from trine.engine.trainer import Trainer
from trine.engine.weights import load_model

from test_losses import randomize

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
    with torch.no_grad():
        want = model(TOKENS, adapters=AdapterBatch.single(trainer.adapter("r")))
        base = model(TOKENS)
    return path, want, base


def hf_logits(path):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(TOKENS).logits


def test_merged_export_gives_trines_adapter_logits_with_tied_embeddings_untied(saved, tiny_model_dir, tmp_path):
    path, want, base = saved
    out = tmp_path / "merged"
    r = CliRunner().invoke(main, ["export", str(path), str(out), "--merged"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    got = hf_logits(out)
    assert (want - base).abs().max() > 1e-2  # the adapter (unembedding included) matters
    assert (got - want).abs().max() <= 1e-4
    # the untied input embeddings are still the base model's
    from safetensors.torch import load_file
    merged, orig = load_file(str(out / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    assert torch.equal(merged["model.embed_tokens.weight"], orig["model.embed_tokens.weight"])
    # a second export into the same (now non-empty) directory is refused, not mixed in
    again = CliRunner().invoke(main, ["export", str(path), str(out), "--merged"])
    assert again.exit_code != 0 and "not an empty directory" in again.output


def test_adapter_export_loads_with_peft_from_its_own_config(saved, tmp_path):
    from peft import AutoPeftModelForCausalLM
    path, want, _ = saved
    out = tmp_path / "adapter"
    r = CliRunner().invoke(main, ["export", str(path), str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    m = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (m(TOKENS).logits - want).abs().max() <= 1e-4


def test_export_refuses_unknown_checkpoint(tmp_path):
    r = CliRunner().invoke(main, ["export", "trio://nope", str(tmp_path / "o"), "--home", str(tmp_path)])
    assert r.exit_code == 2 and "trine checkpoints" in r.output
    (tmp_path / "not-a-checkpoint").mkdir()
    r = CliRunner().invoke(main, ["export", str(tmp_path / "not-a-checkpoint"), str(tmp_path / "o")])
    assert r.exit_code == 1 and "is not a LoRA checkpoint" in r.output and not (tmp_path / "o").exists()


def test_download_checkpoint_into_a_directory_extracts_a_peft_adapter(tiny_model_dir, tmp_path):
    import trine as trio
    from serverutil import serve

    with serve(tiny_model_dir, tmp_path / "home") as srv, \
            trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
        trainer = service.create_lora_training_client("tiny-llama", rank=4)
        saved = trainer.save_weights_for_sampler("exported").result()
        rest = service.create_rest_client()
        ck = next(c for c in rest.list_checkpoints(trainer.training_run_id).result().checkpoints
                  if c.path == saved.path)
        target = tmp_path / "adapter"
        target.mkdir()
        result = rest.download_checkpoint(ck.checkpoint_id, target).result()
        assert result.path == str(target)
        assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        cfg = json.loads((target / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())
        assert cfg["trine_base_model"] == "tiny-llama"
        # a file name still gets the archive itself
        tar = rest.download_checkpoint(ck.checkpoint_id, tmp_path / "ck.tar").result()
        assert tar.file_size_bytes == (tmp_path / "ck.tar").stat().st_size > 0
