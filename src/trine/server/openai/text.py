"""Text <-> tokens for one served model, as the OpenAI routes need it: prompts (a chat under the
model's chat template, or completion text) and incremental decoding for streams. The tokenizer and
its chat template are the service's (`Queries.tokenizer`).
"""

from __future__ import annotations

import asyncio

from ...service import ModelTokenizer
from . import tool_calls
from .errors import OpenAIError


class ModelText:
    def __init__(self, tokenizer: ModelTokenizer):
        self.tokenizer = tokenizer  # the served model's (encode, decode, chat_prompt)

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids are used as they are; text is encoded as the tokenizer does by default
        (with the special tokens its post-processor adds, e.g. a BOS token)."""
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    async def prompt_ids(
        self,
        messages: list[dict] | None,
        prompt: str | list[int] | None,
        context: int,
        tools: list[dict] | None = None,
        tool_messages: bool = False,
    ) -> list[int]:
        """The prompt's token ids, encoded off the event loop. A text longer than `context` tokens
        could possibly be, counted in characters, is refused before it is tokenized. A chat with
        `tools` (or with past tool calls and results) needs a chat template that supports tools in
        the Hermes format (400 naming the field otherwise)."""
        chars = _chars(messages if messages is not None else prompt)
        if chars > self.tokenizer.most_chars(context):
            param = "messages" if messages is not None else "prompt"
            raise OpenAIError(
                400,
                f"{param}: {chars} characters of text exceed this model's maximum context "
                f"length of {context} tokens. Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

        def chat() -> list[int]:
            if tools or tool_messages:
                self.require_tools("tools" if tools else "messages")
            return self.tokenizer.chat_prompt(messages, tools)

        fn = chat if messages is not None else (lambda: self.completion_prompt(prompt))
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    def require_tools(self, param: str) -> None:
        """OpenAIError naming `param` unless the model's chat template renders tools and teaches the
        `<tool_call>` format trine parses. Blocking (loads the template once)."""
        fmt = tool_calls.call_format(self.tokenizer)
        if fmt == "hermes":
            return
        name = self.tokenizer.name
        why = (
            (
                f"the chat template of {name} renders tools, but not as the <tool_call> JSON blocks "
                "(Hermes format, as Qwen-family templates) that trine parses tool calls from"
            )
            if fmt
            else (
                f"the chat template of {name} has no tools support (it does not render tool definitions or "
                "tool results), so the model was never shown how to call them"
            )
        )
        raise OpenAIError(
            400,
            f"{param}: {why}. Serve a model whose chat template supports tools "
            "(Qwen-family templates do), or send the conversation without tools.",
            param=param,
            code="unsupported_parameter",
        )

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _chars(value) -> int:
    """Characters in every string of a prompt or message list (nested dicts and lists)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        value = list(value.values())
    return sum(_chars(v) for v in value) if isinstance(value, list) else 0


class TextStream:
    """Turns one sequence's tokens, arriving a few at a time, into text pieces.

    Invariant: the pieces concatenate to a prefix of the sequence's final text, and `finish(text)`
    returns the rest. Text is held back while it ends in an incomplete UTF-8 character, or could
    be the start of a stop string (the engine cuts the final text before a stop string)."""

    def __init__(self, tokenizer: ModelTokenizer, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] decode to text already accounted for
        self.read = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        self.tokens += tokens
        before = self.tok.decode(self.tokens[self.prefix : self.read])
        now = self.tok.decode(self.tokens[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self.prefix, self.read = self.read, len(self.tokens)
        if self.stopped:
            return ""
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(self.text) - self.hold
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, cut at the stop string, without a stop token)."""
        sent = self.text[: self.sent]
        return final_text[len(sent) :] if final_text.startswith(sent) else ""
