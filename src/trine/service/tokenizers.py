"""A served model's text handling, as front ends use it: encode, decode, the chat template and the
files a client needs to rebuild the tokenizer.

The chat template is applied by `transformers` (exactly as `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`), loaded from the model directory on first use (importing
transformers is slow); nothing is fetched from a hub. Blocking calls: run them in a thread.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..engine.model.tokenizer import Tokenizer
from .errors import InvalidRequest

TOOL_PROBE_NAME = "trine_probe_tool"  # the tool tool_probe() renders


class ModelTokenizer:
    def __init__(self, name: str, model_dir: Path):
        self.name = name
        self.dir = Path(model_dir)
        self._tok = Tokenizer(model_dir)
        self._chat = None  # the transformers tokenizer, for its chat template
        self._tool_probe: str | None = None  # tool_probe(), once rendered
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def added_token_id(self, text: str) -> int | None:
        """The id of `text` when the tokenizer has it as one added token (e.g. Qwen's `<tool_call>`)."""
        return self._tok.added_token_id(text)

    def files(self) -> list[Path]:
        """The files a client needs to rebuild this tokenizer locally."""
        return self._tok.files()

    def most_chars(self, tokens: int) -> int:
        """More characters than this cannot encode to `tokens` tokens or fewer: no token covers more
        than the longest vocabulary entry (doubled: normalisation may merge characters)."""
        if not hasattr(self, "_longest"):
            self._longest = self._tok.longest_token()
        return 2 * self._longest * tokens

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The token ids of `messages` ([{"role", "content": str}], and the template's tool roles)
        under the model's chat template, with `tools` (OpenAI-shaped function definitions) when
        given, ending with the assistant's generation prompt. InvalidRequest naming `model` (no
        template) or `messages` (the template refused them)."""
        tok = self._chat_tokenizer()
        if not tok.chat_template:
            raise InvalidRequest(
                f"model {self.name} has no chat template; send a plain text prompt (a completion) instead",
                code="model_without_chat_template",
            )
        try:
            ids = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:  # the template refused the conversation (e.g. role order)
            raise InvalidRequest(
                f"messages: the chat template of {self.name} refused them: {e}", code="invalid_messages"
            ) from None
        return list(ids)

    def tool_probe(self) -> str:
        """What the chat template renders for a conversation offering one tool named
        `TOOL_PROBE_NAME` ("" when it has no template or cannot render tools): front ends read from
        it how the template handles tools. Rendered once."""
        if self._tool_probe is None:
            tok = self._chat_tokenizer()
            probe = {
                "type": "function",
                "function": {
                    "name": TOOL_PROBE_NAME,
                    "description": "",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
            try:
                self._tool_probe = (
                    tok.apply_chat_template(
                        [{"role": "user", "content": "hi"}],
                        tools=[probe],
                        add_generation_prompt=True,
                        tokenize=False,
                    )
                    if tok.chat_template
                    else ""
                )
            except Exception:  # a template that cannot render tools
                self._tool_probe = ""
        return self._tool_probe

    def _chat_tokenizer(self):
        with self._lock:
            if self._chat is None:
                from transformers import AutoTokenizer

                self._chat = AutoTokenizer.from_pretrained(str(self.dir), local_files_only=True)
            return self._chat
