"""Tool calling and structured output on /v1/chat/completions: `tools`, `tool_choice`,
`parallel_tool_calls` and `response_format` -> a `Structured` plan, and tool calls back into
OpenAI's `message.tool_calls`.

- `tools` are rendered by the model's chat template (only Hermes-format templates, as Qwen's:
  routes.py checks the model); the reply is parsed back into tool calls unless `tool_choice` is
  "none", which renders no tools and parses nothing.
- `tool_choice` "required" or a named function forces calls by constrained decoding (one call, or
  one or more with `parallel_tool_calls`), the arguments matching the tool's `parameters`.
- `response_format` `json_object` / `json_schema` constrains the whole reply to JSON (matching the
  schema); it cannot be combined with tools the model may call.
Every check names the field it refuses (400).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ...service import ModelTokenizer, grammars
from . import tool_calls
from .errors import bad_param

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Structured:
    """What a chat request asks beyond plain text."""

    tools: list[dict] | None = None  # rendered by the chat template (OpenAI's tool shape)
    parse_calls: bool = False  # read tool calls back out of the reply
    grammar: str = ""  # response_format's constrained decoding (service/grammars.py); "" = none
    forced: dict[str, dict | None] | None = None  # tool_choice required / named: name -> parameters
    several: bool = False  # forced: one or more calls (else exactly one)

    def grammar_on(self, tokenizer: ModelTokenizer) -> str:
        """The grammar to decode the reply under on `tokenizer`'s model ("" = none): a forced
        call's tags are that tokenizer's own `<tool_call>` tokens where it has them."""
        if self.forced is None:
            return self.grammar
        return tool_calls.forcing_grammar(
            self.forced,
            self.several,
            tokenizer.added_token_id(tool_calls.OPEN),
            tokenizer.added_token_id(tool_calls.CLOSE),
        )


def parse_structured(body: dict) -> Structured:
    """The plan of a chat body's tools and response_format (400 naming the field it refuses)."""
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    json_grammar = _response_format(body.get("response_format"))
    if json_grammar and choice != "none":
        raise bad_param(
            "response_format",
            "cannot be combined with tools the model may call: set "
            'tool_choice to "none", or drop response_format',
        )
    if choice == "none":
        return Structured(grammar=json_grammar)
    if choice == "auto":
        return Structured(list(tools.values()), True)
    forced = {n: t["function"].get("parameters") for n, t in tools.items() if named in (None, n)}
    several = choice == "required" and parallel is not False
    _checked(partial(tool_calls.forcing_grammar, forced, several), "tools")
    return Structured(list(tools.values()), True, forced=forced, several=several)


def tool_calls_json(calls: list[tool_calls.ToolCall]) -> list[dict]:
    """OpenAI's `message.tool_calls`: a fresh id per call, arguments as a JSON string."""
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]


def assistant_tool_calls(calls: Any, where: str) -> list[dict]:
    """A past assistant message's `tool_calls`, for the chat template: arguments as objects (the
    form Hermes templates serialise)."""
    if not isinstance(calls, list):
        raise bad_param(f"{where}.tool_calls", "must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if isinstance(c, dict) and c.get("type", "function") != "function":
            raise bad_param(f"{at}.type", f'must be "function", got {c["type"]!r}')
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_param(at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad_param(f"{at}.function.arguments", "must be a JSON object (as a string)")
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


# ---------------------------------------------------------------------------- checks
def _tools(tools: Any) -> dict[str, dict]:
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise bad_param("tools", "must be a list of function tools")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_param(
                at,
                'must be {"type": "function", "function": {"name", "description", '
                '"parameters"}}; only function tools are supported',
            )
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_param(f"{at}.function.name", "must be 1 to 64 letters, digits, _ or -")
        if name in out:
            raise bad_param(f"{at}.function.name", f"{name!r} is defined twice")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_param(f"{at}.function.parameters", "must be a JSON schema object")
            if params.get("type", "object") != "object":
                raise bad_param(
                    f"{at}.function.parameters",
                    f'must be an object schema ("type": "object"): a call\'s arguments are named; got '
                    f'"type": {json.dumps(params.get("type"))}',
                )
            _checked(partial(grammars.json_schema, params), f"{at}.function.parameters")
        out[name] = {
            "type": "function",
            "function": {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")},
        }
    return out


def _choice(choice: Any, tools: dict[str, dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("named", the function it forces)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise bad_param(
                "tool_choice",
                'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            )
        if fn["name"] not in tools:
            raise bad_param("tool_choice", f"names function {fn['name']!r}, which is not in tools")
        return "named", fn["name"]
    if choice not in CHOICES:
        raise bad_param(
            "tool_choice", f'must be "none", "auto", "required" or a named function, got {choice!r}'
        )
    if choice != "none" and not tools:
        raise bad_param("tool_choice", f"is {choice!r} but no tools are given; add tools or drop tool_choice")
    return choice, None


def _response_format(fmt: Any) -> str:
    """The grammar of the JSON the reply must be, or "" for plain text."""
    if fmt is None:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return grammars.json_schema({"type": "object"})
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise bad_param("response_format.json_schema", 'must be {"name", "schema", "strict"}')
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_param("response_format.json_schema.schema", "must be a JSON schema object")
        return _checked(partial(grammars.json_schema, schema), "response_format.json_schema.schema")
    raise bad_param(
        "response_format",
        'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
    )


def _checked(build: Callable[[], str], param: str) -> str:
    """The grammar `build` returns, or a 400 naming `param` where llguidance refuses to build or
    compile it (a schema nested past its recursion limit raises while being built)."""
    try:
        grammar = build()
    except (ValueError, RecursionError) as e:
        problem = str(e) or type(e).__name__
    else:
        problem = grammars.problem(grammar)
    if problem:
        raise bad_param(
            param, f"constrained decoding cannot use this schema: {problem.strip()}", "unsupported_value"
        )
    return grammar
