"""Grammars for constrained decoding, in llguidance's format: the plain string an engine request
carries (`SamplingOptions.grammar`) and the engine compiles against its
own tokenizer (engine/sampler/grammar.py).

JSON is generated compact (`", "` and `": "` separators, no other whitespace), as `json.dumps`
writes it: a schema then admits one spelling per value, and a model cannot pad its output with
whitespace until max_tokens.
"""

from __future__ import annotations

import json

COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def json_schema(schema: dict) -> str:
    """The grammar of one JSON value that matches `schema`."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)


def lark(text: str) -> str:
    """The grammar of a Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def embedded_json(schema: dict) -> str:
    """`schema` as a Lark `%json` term, generated compact like `json_schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT})


def problem(grammar: str) -> str:
    """Why `grammar` cannot be compiled (e.g. a JSON schema keyword llguidance does not
    implement), or "" when it can."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)
