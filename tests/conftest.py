"""Shared fixtures: tiny random-weight models of each supported family with SmolLM2's real tokenizer.

Each model directory is a real Hugging Face checkpoint (config.json + model.safetensors + tokenizer
files), so tests go through the same loading path as real checkpoints.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRINE_TELEMETRY", "0")
# The suite's float bounds are an fp32 engine's: `--dtype auto` (the default) means fp32 here on any
# CPU (it could measure bf16 faster on some); tests/engine/test_dtype_choice.py tests auto itself.
os.environ.setdefault("TRINE_AUTO_DTYPE", "float32")
torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER_DIR = FIXTURES / "smollm2-tokenizer"
FAMILIES = ("llama", "qwen2", "qwen3")


# The tiny models' shape and special tokens, every family's.
TINY_SHAPE = dict(
    hidden_size=96,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def build_tiny_model_dir(
    family: str, out: Path, seed: int = 0, tie: bool = True, vocab_size: int = 49152
) -> Path:
    """A ~5M-parameter random model of `family` saved as a Hugging Face checkpoint directory."""
    import transformers as tf

    common = dict(
        TINY_SHAPE,
        vocab_size=vocab_size,
        num_hidden_layers=4,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    return save_tiny(cls_model(cls_cfg(**common)), out)


def save_tiny(model, out: Path) -> Path:
    """`model` (transformers', random) with non-trivial norms and biases, so that their loading is
    actually tested, saved by transformers with SmolLM2's tokenizer."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    return out


def build_tiny_qwen3_5_dir(out: Path, seed: int = 0, tie: bool = True, vocab_size: int = 49152) -> Path:
    """A tiny random Qwen3.5 text model (layers: linear, linear, full, linear, full; Gated DeltaNet
    and gated attention), saved by transformers, with SmolLM2's tokenizer (no Qwen tokenizer is
    available offline: tests/fixtures/README.md; a smaller `vocab_size` keeps its first ids)."""
    import transformers as tf

    cfg = tf.Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=5,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms so that their loading (and 1 + w) is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory) -> Path:
    """`build_tiny_qwen3_5_dir`'s model, once a session (the engine's, sampler's and server's tests)."""
    return build_tiny_qwen3_5_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3_5")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {fam: build_tiny_model_dir(fam, root / f"tiny-{fam}") for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_qwen_tools_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model whose chat template (Qwen2.5's) supports tools. As in Qwen's own
    tokenizer, `<tool_call>` and `</tool_call>` are single added (non-special) tokens, and the
    model's vocabulary is padded beyond the tokenizer's (49216 > 49154)."""
    from tokenizers import AddedToken, Tokenizer

    out = build_tiny_model_dir(
        "qwen2", tmp_path_factory.mktemp("models") / "tiny-qwen-tools", vocab_size=49216
    )
    shutil.copy(FIXTURES / "qwen2.5-chat-template" / "chat_template.jinja", out / "chat_template.jinja")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> Path:
    """A tiny random `qwen3_5` checkpoint with its vision tower (tests/visionutil.py): its engine
    serves images."""
    from visionutil import build_tiny_qwen3_5_vl_dir

    return build_tiny_qwen3_5_vl_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3_5-vl")


@pytest.fixture(scope="session")
def tiny_vision_frontend_dir(tmp_path_factory) -> Path:
    """A tiny random Llama served beside a qwen3_5 image processor (tests/visionutil.py): the front
    ends read and check its images; its engine serves text only."""
    from visionutil import VOCAB, add_vision_processor

    return add_vision_processor(
        build_tiny_model_dir("llama", tmp_path_factory.mktemp("models") / "tiny-vl", vocab_size=VOCAB)
    )


@pytest.fixture(autouse=True)
def gemm_dispatch_unmeasured():
    """An engine's start installs its GEMM choice process-wide (engine/model/kernels/gemm.py), also
    one a module's fixture starts: each test starts from none (packed where it applies), so what a
    test asserts of the packed path does not depend on which engines ran before it."""
    from trine.engine.model.kernels import gemm

    gemm.reset()
    yield
    gemm.reset()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs) -> Path:
    """The default tiny model for tests that need one model: Llama family, like SmolLM2."""
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_model64(tiny_model_dir):
    """`tiny_model_dir`'s model in fp64: the twin that measures a comparison's fp32 rounding
    (tolerance.py, kind 3). Its weights are never trained (adapters are separate), so one serves all."""
    from tolerance import fp64_model

    return fp64_model(tiny_model_dir)


@pytest.fixture()
def client(server):
    """A raw PyTRIO wire client (serverutil.RawClient) on the test module's `server` fixture."""
    from serverutil import RawClient

    c = RawClient(server.url, server.api_key)
    yield c
    c.close()


def pytest_report_header(config):
    """The kernel path this run's numerics are on (tolerance.py; `make test-portable` runs another)."""
    from trine.engine.model.kernels import cbuild

    cpu = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), "?")
    torch_path = torch.backends.cpu.get_cpu_capability()
    return f"kernel path: {cpu}; torch {torch_path}, C kernels {cbuild.march_flag()}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


WINDOWED_FAMILIES = ("gemma3", "olmo3")
# A window the tests' 40-token prompts cross, and both layer kinds (the third layer global).
TINY_WINDOW = 8
TINY_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def build_tiny_windowed_dir(
    family: str,
    out: Path,
    seed: int = 0,
    layer_types: tuple[str, ...] = TINY_LAYER_TYPES,
    window: int = TINY_WINDOW,
    **config,
) -> Path:
    """A tiny random sliding-window model (`gemma3`: Gemma 3's text model, `olmo3`) saved by
    transformers with SmolLM2's tokenizer; `config` overrides the model config's fields."""
    import transformers as tf

    common = dict(
        TINY_SHAPE,
        vocab_size=49152,
        num_hidden_layers=len(layer_types),
        sliding_window=window,
        layer_types=list(layer_types),
        tie_word_embeddings=True,
    )
    if family == "gemma3":  # a query scale other than head_dim's, and distinct thetas per kind
        rope = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
        common.update(query_pre_attn_scalar=32, rope_parameters=rope)
        cls_cfg, cls_model = tf.Gemma3TextConfig, tf.Gemma3ForCausalLM
    else:
        cls_cfg, cls_model = tf.Olmo3Config, tf.Olmo3ForCausalLM
    torch.manual_seed(seed)
    return save_tiny(cls_model(cls_cfg(**{**common, **config})), out)  # Gemma's norms: 1 + w


@pytest.fixture(scope="session")
def tiny_windowed_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny model of each sliding-window family (`build_tiny_windowed_dir`), and `gemma3-sliding`:
    every layer windowed (the sampler frees the blocks that slide out: sampler/window.py)."""
    root = tmp_path_factory.mktemp("windowed")
    dirs = {fam: build_tiny_windowed_dir(fam, root / f"tiny-{fam}") for fam in WINDOWED_FAMILIES}
    sliding = ("sliding_attention",) * 3
    dirs["gemma3-sliding"] = build_tiny_windowed_dir(
        "gemma3", root / "tiny-gemma3-sliding", layer_types=sliding
    )
    return dirs
