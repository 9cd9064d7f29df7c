"""The tokenizer a model directory ships: tokenizer.json, its special tokens and chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """Encode / decode with the `tokenizers` library; knows the model's stop (EOS) token ids."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        path = self.dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{self.dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = self.dir / name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                if eos is not None:
                    ids += eos if isinstance(eos, list) else [eos]
        f = self.dir / "tokenizer_config.json"
        if f.is_file():
            tok = json.loads(f.read_text()).get("eos_token")
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok and self._tok.token_to_id(tok) is not None:
                ids.append(self._tok.token_to_id(tok))
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def longest_token(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more characters of text."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def files(self) -> list[Path]:
        """The files a client needs to rebuild this tokenizer locally."""
        names = (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
            "generation_config.json",
        )
        return [self.dir / n for n in names if (self.dir / n).is_file()]

    def added_token_id(self, text: str) -> int | None:
        """The id of `text` when the tokenizer has it as one added token (e.g. Qwen's `<tool_call>`)."""
        return next((i for i, t in self._tok.get_added_tokens_decoder().items() if t.content == text), None)

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what llguidance builds its token table from)."""
        return self._tok.to_str()
