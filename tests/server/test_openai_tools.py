"""Tool calling and structured output on the OpenAI routes, with the official `openai` client.

The model is a tiny random-weight Qwen2 whose chat template is Qwen2.5's (it renders `tools` and
teaches `<tool_call>` blocks); its replies are noise, so every structure asserted here comes from
constrained decoding (llguidance) or the chat template, never from the model having learnt it.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from serverutil import serve
from transformers import AutoTokenizer

from trine.server.openai import tool_calls

MODEL, PLAIN = "tiny-qwen-tools", "tiny-llama"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Report(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    rain_mm: int = Field(ge=0, le=500)
    windy: bool


@pytest.fixture(scope="module")
def server(tiny_qwen_tools_dir, tiny_model_dir, tmp_path_factory):
    with serve([tiny_qwen_tools_dir, tiny_model_dir], tmp_path_factory.mktemp("tools-home")) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key=server.api_key,
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )


@pytest.fixture(scope="module")
def hf_tok(tiny_qwen_tools_dir):
    return AutoTokenizer.from_pretrained(str(tiny_qwen_tools_dir), local_files_only=True)


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("celsius", "fahrenheit")
    assert set(args) == {"city", "unit"}
    return args


# ----------------------------------------------------------------------------- structured output
def test_json_schema_response_format_parses_into_the_pydantic_model(oai):
    r = oai.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Report."}],
        response_format=Report,
        n=3,
        max_tokens=60,
        seed=1,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Report)
        assert Report.model_validate_json(choice.message.content) == choice.message.parsed
    assert len({c.message.content for c in r.choices}) > 1  # three samples, each constrained


def test_json_schema_streams_the_same_json(oai):
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "report",
            "strict": True,
            "schema": {**Report.model_json_schema(), "additionalProperties": False},
        },
    }
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream a report."}],
        response_format=fmt,
        max_tokens=60,
        seed=5,
    )
    whole = oai.chat.completions.create(**args).choices[0].message.content
    text = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert text == whole and Report.model_validate_json(text)


def test_json_object_response_format_gives_a_json_object(oai):
    r = oai.chat.completions.create(
        model=PLAIN,
        messages=[{"role": "user", "content": "JSON please."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        seed=3,
        temperature=0.7,
        logprobs=True,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    # the logprobs are those of the masked distribution the tokens were drawn from: finite
    assert all(t.logprob > -9999 for t in choice.logprobs.content)


# ----------------------------------------------------------------------------- tool calls
def test_required_tool_choice_returns_parsed_tool_calls(oai, hf_tok):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=120,
        seed=2,
        n=2,
        extra_body={"return_token_ids": True},
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        # the call opens with the tokenizer's own <tool_call> token, as a Qwen model writes it
        assert choice.token_ids[0] == hf_tok.convert_tokens_to_ids("<tool_call>")
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            if call.function.name == "get_time":
                assert json.loads(call.function.arguments) == {}
            else:
                check_weather_call(call)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_named_tool_choice_forces_exactly_that_function(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[CLOCK, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        seed=4,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_weather_call(calls[0])


def test_required_without_parallel_calls_gives_one_call(oai):
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            seed=seed,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
        )
        assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_match_the_whole_response(oai):
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, seed=7)
    whole = oai.chat.completions.create(**args).choices[0]
    chunks = list(oai.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (i, t.function.name, t.function.arguments) for i, t in enumerate(whole.message.tool_calls)
    ]
    assert all(t.id.startswith("call_") and t.type == "function" for t in streamed)
    assert not "".join(d.content or "" for d in deltas)  # the <tool_call> text is not streamed as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip_is_rendered_by_the_chat_template(oai, hf_tok):
    first = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=80,
        seed=9,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        first.choices[0].message,  # the client sends the message object back as it is
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    second = oai.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, extra_body={"return_token_ids": True}
    )
    # as transformers renders it, arguments as an object (the form the template serialises)
    want = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        {"role": "tool", "content": "18 degrees, sunny"},
    ]
    ids = hf_tok.apply_chat_template(
        want, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert second.prompt_token_ids == list(ids)
    prompt = hf_tok.decode(second.prompt_token_ids)
    assert "The weather in a city today." in prompt and "<tool_response>\n18 degrees, sunny" in prompt
    assert call.function.arguments in prompt  # the past call, spelt as constrained decoding wrote it


def test_auto_renders_the_tools_and_none_does_not(oai, hf_tok):
    ids = {}
    for choice in ("auto", "none"):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=3,
            extra_body={"return_token_ids": True},
        )
        ids[choice] = r.prompt_token_ids
    assert "get_weather" in hf_tok.decode(ids["auto"]) and "get_weather" not in hf_tok.decode(ids["none"])


def test_tool_calls_are_parsed_from_hermes_blocks():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>'
    )
    content, calls = tool_calls.parse(text)
    assert content == "Let me check.\n"
    assert calls == [
        tool_calls.ToolCall("get_weather", {"city": "Oslo"}),
        tool_calls.ToolCall("get_time", {}),
    ]
    for broken in (
        '<tool_call>\n{"name": "f", "arguments": {</tool_call>',
        "<tool_call>\n{}\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {}}\n',
    ):
        assert tool_calls.parse(broken) == (broken, [])  # a malformed call stays text


# ----------------------------------------------------------------------------- refusals
def nested(depth: int) -> dict:
    """A JSON schema of objects `depth` deep (past llguidance's recursion limit at 100)."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD = [
    (dict(model=PLAIN, tools=[WEATHER]), "tools", "has no tools support"),
    (
        dict(
            model=PLAIN,
            messages=ASK
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        ),
        "messages",
        "has no tools support",
    ),
    (
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
        "not in tools",
    ),
    (dict(tool_choice="required"), "tool_choice", "no tools"),
    (
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        "tools[0].function.name",
        "letters",
    ),
    (
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
        "cannot be combined",
    ),
    (
        dict(
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}
            ]
        ),
        "tools[0].function.parameters",
        "cannot use this schema",
    ),
    # nested past llguidance's recursion limit: used to be a 500 (its ValueError while building)
    (
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested(120)}}),
        "response_format.json_schema.schema",
        "recursion limit",
    ),
    (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(120)}}]),
        "tools[0].function.parameters",
        "recursion limit",
    ),
    (
        dict(
            messages=[
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
                    ],
                }
            ]
        ),
        "messages[0].tool_calls[0].function.arguments",
        "JSON object",
    ),
]


CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ],
}
BAD += [
    (  # a call's arguments are named: OpenAI requires an object schema
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
        "tools[0].function.parameters",
        "object schema",
    ),
    (
        dict(messages=ASK + [CALLED, {"role": "tool", "content": "sunny"}]),
        "messages[2].tool_call_id",
        "missing",
    ),
    (
        dict(messages=ASK + [CALLED, {"role": "tool", "tool_call_id": 5, "content": "sunny"}]),
        "messages[2].tool_call_id",
        "missing",
    ),
    (
        dict(messages=ASK + [CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]),
        "messages[2].tool_call_id",
        "answers no tool call",
    ),
    (
        dict(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}] + ASK),
        "messages[0]",
        "earlier assistant message",
    ),
    (
        dict(messages=ASK + [{**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "type": "bogus"}]}]),
        "messages[1].tool_calls[0].type",
        "function",
    ),
]


@pytest.mark.parametrize("kw,param,says", BAD, ids=[b[1] for b in BAD])
def test_what_cannot_be_served_is_refused_naming_the_field(oai, kw, param, says):
    args = {"model": MODEL, "messages": ASK, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**args)
    assert e.value.body["param"] == param and says in e.value.body["message"]


def test_completions_refuse_response_format(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"response_format": {"type": "json_object"}}
        )
    assert e.value.body["param"] == "response_format" and "/v1/chat/completions" in e.value.body["message"]


class City(BaseModel):
    name: Literal["Paris", "Oslo"]


class Trip(BaseModel):
    to: City  # a nested model: its schema is a $ref into $defs
    back: City


def test_a_forced_call_whose_parameters_use_refs_matches_them(oai):
    """pydantic (and `openai.pydantic_function_tool`) put nested models in `$defs` and point at them
    with root-relative `$ref`s; forced, the arguments sit inside the call's schema, where the refs
    must still resolve."""
    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required", max_tokens=80, seed=0
    )
    call = r.choices[0].message.tool_calls[0]
    Trip.model_validate_json(call.function.arguments)
