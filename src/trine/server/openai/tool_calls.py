"""Tool calls in the Hermes format that Qwen-family chat templates teach their models: each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several separated by a newline.

`call_format` tells whether a model's chat template teaches this format; `parse` reads a generated
text back into calls; `forcing_grammar` is the grammar that makes a
model emit calls (constrained decoding), byte for byte in the format `parse` reads and the chat
template renders for past calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...service import ModelTokenizer, grammars
from ...service.tokenizers import TOOL_PROBE_NAME

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls) when every `<tool_call>` block in `text` holds a
    JSON object with a string `name` and object `arguments`; else (text, []): a malformed call
    stays text, so nothing the model wrote is lost."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _BLOCK.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)):
            return text, []
        calls.append(ToolCall(obj["name"], args))
    if not calls or text.count(OPEN) != len(calls):
        return text, []
    return text[:start], calls


def forcing_grammar(
    tools: dict[str, dict | None], several: bool, open_id: int | None = None, close_id: int | None = None
) -> str:
    """The grammar of one call (`several`: one or more) to any of `tools` (name -> the JSON schema
    of its arguments, None for none), with the arguments matching that tool's schema. `open_id` /
    `close_id`: the tokenizer's own token for `<tool_call>` / `</tool_call>` when it has one (as
    Qwen's does), which the call must then use: constrained decoding never spells an added token
    out of plain-text pieces."""
    calls = [grammars.embedded_json(_call_schema(name, params)) for name, params in tools.items()]
    alternatives = " | ".join(calls)
    start = 'start: call ("\\n" call)*' if several else "start: call"
    open_ = f"<[{open_id}]>" if open_id is not None else f'"{OPEN}"'
    close = f"<[{close_id}]>" if close_id is not None else f'"{CLOSE}"'
    return grammars.lark(f'{start}\ncall: {open_} "\\n" ({alternatives}) "\\n" {close}\n')


def _call_schema(name: str, params: dict | None) -> dict:
    """The schema of one call to `name`: {"name": name, "arguments": matching params}. The
    parameters' definitions (`$defs`, `definitions`) move to the call's root, and their other
    root-relative `$ref`s get the path the arguments sit at, so every reference still resolves."""
    params = dict(params or NO_PARAMETERS)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    call = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "arguments"],
        "properties": {"name": {"const": name}, "arguments": _rebased(params)},
    }
    return call | {k: _rebased(v) for k, v in defs.items()}


def _rebased(schema: Any) -> Any:
    """`schema` with each `$ref` to the parameters' root ("#", "#/properties/...") pointed at
    `#/properties/arguments`; references to the definitions are left as they are."""
    if isinstance(schema, list):
        return [_rebased(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        if not ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = "#/properties/arguments" + ref[1:]
    return out


def call_format(tokenizer: ModelTokenizer) -> str | None:
    """How the model's chat template handles tools: "hermes" when it renders tool definitions and
    teaches these `<tool_call>` blocks, "other" when it renders them in another format, None when it
    has no tools support (it ignores them). Blocking (loads the template once)."""
    text = tokenizer.tool_probe()
    return None if TOOL_PROBE_NAME not in text else "hermes" if OPEN in text else "other"
