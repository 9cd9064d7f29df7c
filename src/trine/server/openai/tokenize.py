"""vLLM's tokenizer routes, `POST /tokenize` and `POST /detokenize`: a harness counts and decodes
tokens with the served model's own tokenizer (and chat template), as the generation routes do.

`/tokenize` takes `prompt` (with `add_special_tokens`, default true: what /v1/completions encodes) or
`messages` (rendered by the chat template with the generation prompt, exactly as
/v1/chat/completions renders them; `add_special_tokens` default false, as the template writes its
own) and answers `{count, max_model_len, tokens, token_strs}`; `return_token_strs` gives each token
decoded alone. `/detokenize` takes `tokens` and answers `{prompt}`. `GET /tokenizer_info`
(`?model=`) answers the tokenizer's configuration (special tokens, `chat_template`,
`max_model_len`), what lm-evaluation-harness's remote tokenizer reads. `model` may be omitted when
one model is served; a sampler checkpoint names its base model's tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ...service import ApiKey
from . import models as targets
from .bodies import _bool, _messages, _object, _prompt, _refuse_unsupported
from .errors import OpenAIError, bad_param

TOKENIZE_PROMPT = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT = {
    "model",
    "messages",
    "add_special_tokens",
    "return_token_strs",
    "add_generation_prompt",
    "continue_final_message",
}
DETOKENIZE = {"model", "tokens"}


def _target(st, key: ApiKey, body: dict) -> targets.ModelTarget:
    model = body.get("model")
    if model is None:
        served = [m.name for m in st.service.queries.models()]
        if len(served) != 1:
            raise bad_param(
                "model", f"name one of the served models ({', '.join(served)})", "missing_required_parameter"
            )
        model = served[0]
    if not isinstance(model, str) or not model.strip():
        raise bad_param("model", "must be a model name or a sampler checkpoint's path")
    return targets.resolve(st.service, key, model.strip())


async def tokenize(st, key: ApiKey, body: Any) -> dict:
    body = _object(body)
    chat = "messages" in body
    _refuse_unsupported(body, TOKENIZE_CHAT if chat else TOKENIZE_PROMPT)
    if chat and "prompt" in body:
        raise bad_param("prompt", "give either prompt or messages, not both")
    target = _target(st, key, body)
    text = st.text(target.base)
    special = body.get("add_special_tokens")
    special = (not chat) if special is None else _bool(body, "add_special_tokens")
    strs = _bool(body, "return_token_strs")
    if chat:
        messages = _messages(body.get("messages"))
        if body.get("add_generation_prompt") is False or _bool(body, "continue_final_message"):
            param = (
                "add_generation_prompt"
                if body.get("add_generation_prompt") is False
                else "continue_final_message"
            )
            raise OpenAIError(
                400,
                f"{param}: the chat template is applied with the generation prompt, as "
                "/v1/chat/completions applies it; remove it",
                param=param,
                code="unsupported_parameter",
            )
        _bool(body, "add_generation_prompt")
        ids = await text.prompt_ids(messages, None, _context(st, target))
        if special:  # what the tokenizer's post-processor adds to a text (e.g. a BOS token), once more
            ids = text.tokenizer.encode("", add_special_tokens=True) + ids
    else:
        prompt = _prompt(body.get("prompt"), "prompt")
        if isinstance(prompt, list):
            raise bad_param("prompt", "must be a string (token ids are already tokenized)")
        ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: text.tokenizer.encode(prompt, add_special_tokens=special)
        )
    return {
        "count": len(ids),
        "max_model_len": _context(st, target),
        "tokens": ids,
        "token_strs": [text.token_text(t) for t in ids] if strs else None,
    }


async def detokenize(st, key: ApiKey, body: Any) -> dict:
    body = _object(body)
    _refuse_unsupported(body, DETOKENIZE)
    target = _target(st, key, body)
    tokens = body.get("tokens")
    vocab = st.service.queries.model(target.base).vocab_size
    if not isinstance(tokens, list) or any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < (vocab or 2**31) for t in tokens
    ):
        raise bad_param(
            "tokens",
            f"must be a list of token ids (integers in [0, {vocab}))",
            "missing_required_parameter" if tokens is None else "invalid_value",
        )
    return {"prompt": st.text(target.base).tokenizer.decode(tokens)}


def _context(st, target: targets.ModelTarget) -> int:
    return st.service.queries.model(target.base).max_seq_len


def tokenizer_info(st, key: ApiKey, model: str | None) -> dict:
    """vLLM's `/tokenizer_info`: the model directory's tokenizer_config.json (special tokens as
    their text), its chat template, and the context the server serves."""
    target = _target(st, key, {} if model is None else {"model": model})
    tok = st.text(target.base).tokenizer
    config = {}
    path = tok.dir / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
    keep = ("bos_token", "eos_token", "pad_token", "unk_token", "tokenizer_class", "chat_template")
    info = {k: config[k] for k in keep if k in config}
    for k, v in info.items():  # an AddedToken as transformers writes it: {"content": ...}
        if isinstance(v, dict) and "content" in v:
            info[k] = v["content"]
    template = tok.dir / "chat_template.jinja"
    if "chat_template" not in info and template.is_file():
        info["chat_template"] = template.read_text()
    info["model_max_length"] = info["max_model_len"] = _context(st, target)
    return info
