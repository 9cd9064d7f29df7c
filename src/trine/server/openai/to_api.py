"""A validated OpenAI request (`Generation`, bodies.py) -> the engine's `SampleRequest`: the only place
OpenAI's parameter names become the engine's vocabulary (`engine/api.py`). A prompt that leaves no
room in the model's context is a 400 `context_length_exceeded` naming the parameter to change.
"""

from __future__ import annotations

from ...engine.api import (
    ImageInput,
    ImagesNotServed,
    SampleRequest,
    SamplingOptions,
    placeholders_to_pieces,
    read_model_input,
)
from ...service import ModelView
from .bodies import Generation
from .errors import OpenAIError


def chat_images(
    g: Generation, prompt: list[int], model: ModelView
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A rendered chat with its images in place: each placeholder the chat template put for an
    image_url part becomes that image's vision tokens (engine/images.py reads and checks them;
    blocking). OpenAIError 400 whose param names the image's part (`messages[0].content[1].image_url`);
    `unsupported_value` for images the model does not take."""
    try:
        pieces = placeholders_to_pieces(prompt, g.images, model.vision)
        return read_model_input(pieces, model.vision, model.name, "messages")
    except ValueError as e:
        param = next((im.field for im in g.images if str(e).startswith(im.field)), "messages")
        refused = isinstance(e, ImagesNotServed) or model.vision is None
        raise OpenAIError(
            400, str(e), param=param, code="unsupported_value" if refused else "invalid_value"
        ) from None


def no_placeholders(g: Generation, prompts: list[list[int]], model: ModelView) -> None:
    """A vision model's text-only prompts hold no image placeholder id (a chat's text or a prompt's
    ids): a placeholder is an image's (engine/images.py), so text that holds one is a 400."""
    if model.vision is None or g.images:
        return
    pad = model.vision.image_token_id
    if any(pad in p for p in prompts):
        param = "messages" if g.chat else "prompt"
        raise OpenAIError(
            400,
            f"{param}: the text holds the image placeholder token (id {pad}) but no image_url part; "
            "send each image as an image_url part (its placeholders are the server's)",
            param=param,
            code="invalid_value",
        )


def sample_request(
    g: Generation,
    rid: str,
    prompt: list[int],
    context: int,
    grammar: str,
    images: tuple[ImageInput, ...] = (),
) -> SampleRequest:
    """One prompt's sampling request (`images`: a chat's, placed in `prompt` by `chat_images`). With
    echo and logprobs, or prompt_logprobs, the engine scores the prompt in the prefill that serves
    it; max_tokens 0 (echo) scores it without generating."""
    max_tokens = tokens_to_generate(g, len(prompt), context)
    options = SamplingOptions(
        max_tokens=max_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        seed=g.seed,
        stop_strings=g.stop,
        stop_token_ids=g.stop_token_ids,
        top_logprobs=g.top_logprobs,
        grammar=grammar,
        presence_penalty=g.presence_penalty,
        frequency_penalty=g.frequency_penalty,
        repetition_penalty=g.repetition_penalty,
        min_p=g.min_p,
        logit_bias=g.logit_bias,
    )
    scored = (g.echo and g.logprobs) or g.prompt_logprobs is not None
    top = max(g.top_logprobs if g.echo and g.logprobs else 0, g.prompt_logprobs or 0)
    return SampleRequest(
        request_id=rid,
        prompt=prompt,
        options=options,
        num_samples=g.best_of or g.n,
        prompt_logprobs=scored,
        topk_prompt_logprobs=top,
        generate=max_tokens > 0,
        reuse_prompt_scores=True,  # a harness's prompts share their few-shot stems: score those once
        images=images,
    )


def tokens_to_generate(g: Generation, prompt: int, context: int) -> int:
    """The tokens to generate: as asked (0: none, echo only), or (unset) up to the end of the model's
    context."""
    if prompt >= context or (g.max_tokens is not None and prompt + g.max_tokens > context):
        field = g.max_tokens_field
        asked = g.max_tokens is not None and prompt < context
        param = field if asked else ("messages" if g.chat else "prompt")
        raise OpenAIError(
            400,
            f"{param}: this model's maximum context length is {context} tokens; the "
            f"prompt has {prompt} tokens and {field} is {g.max_tokens or 'unset'}. "
            f"Shorten the prompt or lower {field}.",
            param=param,
            code="context_length_exceeded",
        )
    return g.max_tokens if g.max_tokens is not None else context - prompt
