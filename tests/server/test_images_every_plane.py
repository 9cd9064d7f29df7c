"""Images on every plane (issue 47): PyTRIO's image chunks (base64 in sample JSON, bytes in MessagePack
events), Tinker's `ImageChunk` (JSON samples, protobuf training) and OpenAI's `image_url` data URLs
are read and checked at acceptance, each bad one a 4xx naming the field with nothing queued or
metered; an image for a text-only model is a 400 naming the model.

The vision model here is a tiny Llama served beside a qwen3_5 image processor (visionutil.py): its
images are read against a real `VisionSpec`, and its engine serves text only, so a valid image is
a 400 `not_supported` saying images are not served yet (the integration with the sampler and the
trainer lifts it)."""

from __future__ import annotations

import base64
import itertools
import zlib

import httpx
import pytest
from PIL import Image
from serverutil import RawClient, event, pytrio_env, serve, tinker_env
from visionutil import IMAGE_TOKEN, encoded, jpeg, png

from trine import limits

TEXT_MODEL, VL_MODEL = "tiny-llama", "tiny-vl"
PNG = png(64, 96)  # 2 x 3 merge blocks: 6 vision tokens
PNG_TOKENS = 6
NOT_SERVED = "the images are valid, but tiny-vl does not serve images yet"


def bomb_png(side: int) -> bytes:
    """A valid PNG declaring side x side pixels in a few kilobytes (one zlib stream of zeros)."""
    import struct

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    head = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\0" * (side + 1) * side, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tiny_vision_frontend_dir, tmp_path_factory):
    models = {TEXT_MODEL: tiny_model_dir, VL_MODEL: tiny_vision_frontend_dir}
    with tinker_env(), serve(models, tmp_path_factory.mktemp("home")) as handle:
        yield handle


@pytest.fixture(scope="module")
def raw(srv):
    c = RawClient(srv.url, srv.api_key)
    yield c
    c.close()


@pytest.fixture(scope="module")
def samplers(raw):
    session = raw.session()
    return {m: raw.sampling_run(session, m) for m in (TEXT_MODEL, VL_MODEL)}


def usage_rows(srv) -> int:
    key = srv.service.authenticate(srv.api_key)
    return len(srv.service.store.usage_events(key.id))


def image_chunk(data: bytes = PNG, fmt: str = "png", expected: int | None = None, b64: bool = True) -> dict:
    return {
        "type": "image",
        "data": base64.b64encode(data).decode() if b64 else data,
        "format": fmt,
        "expected_tokens": expected,
    }


REQUEST_IDS = itertools.count()


def sample_body(chunks: list[dict]) -> dict:
    return {
        "request_id": f"req_{next(REQUEST_IDS):032x}",
        "prompt": {"chunks": chunks},
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        "num_samples": 1,
        "return_text": True,
        "return_token_logprobs": True,
        "return_prompt_logprobs": False,
        "topk_prompt_logprobs": 0,
    }


def text(*tokens: int) -> dict:
    return {"type": "encoded_text", "tokens": list(tokens or [1, 5, 6])}


def assert_refused(r: httpx.Response, *words: str, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    for w in words:
        assert w in body["message"], body["message"]
    return body


# ---------------------------------------------------------------------------- PyTRIO: samples
BAD_SAMPLE_IMAGES = [  # (chunk, words the 400 says: the field first)
    (
        {**image_chunk(), "data": "not base64!"},
        ["prompt.chunks.1.image", "ImageChunk.data", "standard base64"],
    ),
    (image_chunk(b"GIF89a not really"), ["prompt.chunks.1.data", "not a PNG or JPEG"]),
    (image_chunk(PNG[: len(PNG) // 2]), ["prompt.chunks.1.data", "corrupt or truncated PNG"]),
    (image_chunk(jpeg(40, 40)), ["prompt.chunks.1.format is 'png' but the data is a JPEG image"]),
    (image_chunk(PNG, "gif"), ["prompt.chunks.1.image", "ImageChunk.format", "'png' or 'jpeg'"]),
    (image_chunk(bomb_png(30000)), ["prompt.chunks.1.data", f"at most {limits.MAX_IMAGE_PIXELS} pixels"]),
    (image_chunk(encoded(Image.new("L", (4097, 4096)), "PNG")), ["4097x4096", "at most"]),
    (image_chunk(png(2, 500)), ["prompt.chunks.1.data is 500x2", "aspect ratio"]),
    (
        image_chunk(PNG, expected=PNG_TOKENS + 1),
        [
            "prompt.chunks.1.expected_tokens is 7",
            f"{PNG_TOKENS} vision tokens",
            f"send expected_tokens {PNG_TOKENS}",
        ],
    ),
    (
        {"type": "image_asset_pointer", "format": "png", "location": "http://x/y.png"},
        ["trine fetches nothing"],
    ),
]


@pytest.mark.parametrize("chunk,words", BAD_SAMPLE_IMAGES, ids=[w[0] for _, w in BAD_SAMPLE_IMAGES])
def test_pytrio_bad_images_are_400s_naming_the_field(srv, raw, samplers, chunk, words):
    before = usage_rows(srv)
    assert_refused(raw.sample(samplers[VL_MODEL], sample_body([text(), chunk, text()])), *words)
    assert usage_rows(srv) == before  # nothing ran, nothing metered


def test_pytrio_too_many_images_and_placeholders_in_text(raw, samplers):
    many = [image_chunk()] * (limits.MAX_IMAGES_PER_INPUT + 1)
    r = raw.sample(samplers[VL_MODEL], sample_body([text(), *many]))
    assert_refused(r, f"prompt: {len(many)} images; at most {limits.MAX_IMAGES_PER_INPUT}")
    r = raw.sample(samplers[VL_MODEL], sample_body([text(1, IMAGE_TOKEN), image_chunk()]))
    assert_refused(r, f"prompt: a text chunk holds the image placeholder id {IMAGE_TOKEN}")


def test_pytrio_images_to_a_text_model_name_the_model(raw, samplers):
    r = raw.sample(samplers[TEXT_MODEL], sample_body([text(), image_chunk()]))
    assert_refused(r, "prompt.chunks.1: tiny-llama is a text-only model")


def test_pytrio_valid_images_are_read_then_refused_as_not_served(srv, raw, samplers):
    before = usage_rows(srv)
    chunks = [text(), image_chunk(expected=PNG_TOKENS), text(), image_chunk(jpeg(50, 70), "jpeg")]
    body = assert_refused(raw.sample(samplers[VL_MODEL], sample_body(chunks)), NOT_SERVED)
    assert body["code"] == "not_supported"
    ok = raw.sample(samplers[VL_MODEL], sample_body([text(1, 5, 6, 7)]))  # text still samples
    assert ok.status_code == 200 and len(ok.json()["sequences"][0]["tokens"]) == 2, ok.text
    assert usage_rows(srv) == before + 1


# ---------------------------------------------------------------------------- PyTRIO: training
def image_datum(chunk: dict, n_targets: int) -> dict:
    return {
        "data": [
            {
                "model_input": {"chunks": [text(1, 5), chunk, text(7)]},
                "target_ids": [5] * n_targets,
                "weights": [1.0] * n_targets,
            }
        ],
        "auto_shift": False,
        "loss": {"type": "cross_entropy", "config": {}},
    }


@pytest.mark.parametrize(
    "chunk,n,words",
    [
        (image_chunk(PNG[:100], b64=False), 3 + PNG_TOKENS, ["payload.data.0.model_input.chunks.1.data"]),
        (
            image_chunk(PNG, expected=3, b64=False),
            6,
            ["chunks.1.expected_tokens is 3", f"{PNG_TOKENS} vision"],
        ),
        (image_chunk(PNG, b64=False), 3 + PNG_TOKENS, [NOT_SERVED]),
    ],
    ids=["corrupt", "expected_tokens", "valid: not served"],
)
def test_pytrio_training_images_are_checked_before_anything_is_queued(srv, raw, chunk, n, words):
    run, rid = raw.started_run(VL_MODEL, wait=False)
    eid = f"event_img{rid[-6:]}{n}"
    assert_refused(raw.submit(run, event(eid, "forward_backward", 2, image_datum(chunk, n), rid)), *words)
    assert srv.service.store.event(eid) is None  # no index taken, nothing queued


def test_a_datums_fields_count_its_images_tokens(srv):
    """Once a model serves images, a datum's per-token fields have one value per position, image
    tokens included (the message says how many are the images'), and targets that predict an
    image position are ignored."""
    import dataclasses

    from trine.server.pytrio.to_api import parse_command

    model = srv.service.queries.model(VL_MODEL)
    model = dataclasses.replace(model, vision=dataclasses.replace(model.vision, served=True))
    payload = image_datum(image_chunk(PNG, b64=False), 3 + PNG_TOKENS + 1)
    with pytest.raises(Exception, match=r"target_ids has 10 values; model_input has 9 tokens \(6 of them"):
        parse_command("trainer.forward_backward", payload, model)
    op = parse_command("trainer.forward_backward", image_datum(image_chunk(PNG, b64=False), 9), model)
    (d,) = op.data
    assert d.tokens == [1, 5] + [IMAGE_TOKEN] * PNG_TOKENS + [7] and d.images[0].offset == 2
    assert d.target_tokens == [5] + [-100] * PNG_TOKENS + [5, 5]  # positions 1-6 predict image tokens


def test_the_official_pytrio_client_sends_images(srv):
    """pytrio 0.2.9 unmodified: a sample's ImageChunk, and a training datum whose image's token count
    the client infers from the target shape, reach trine's checks (not served yet: a 400)."""
    with pytrio_env(srv.url, srv.api_key) as trio:
        client = trio.ServiceClient()
        try:
            sampler = client.create_sampling_client(base_model=VL_MODEL)
            prompt = trio.ModelInput(
                chunks=[trio.types.EncodedTextChunk(tokens=[1, 5]), trio.ImageChunk(data=PNG, format="png")]
            )
            with pytest.raises(Exception, match=NOT_SERVED):
                sampler.sample(prompt, 1, trio.SamplingParams(max_tokens=2)).result()
            for extra, words in ((0, NOT_SERVED), (2, f"expected_tokens is {PNG_TOKENS + 2}")):
                # a refused event leaves the client's run unusable (its choice): one run each
                tc = client.create_lora_training_client(base_model=VL_MODEL, rank=4)
                n = 2 + PNG_TOKENS + extra  # the target shape implies the image's token count
                datum = trio.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": [5] * n})
                with pytest.raises(Exception, match=words):
                    tc.forward_backward([datum], "cross_entropy").result()
        finally:
            client._runtime.shutdown()


# ---------------------------------------------------------------------------- Tinker
def test_tinker_image_chunks_in_sampling(sc):
    from tinker import types

    def prompt(*chunks):
        return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 5]), *chunks])

    params = types.SamplingParams(max_tokens=2)
    vl = sc.create_sampling_client(base_model=VL_MODEL).result()
    cases = [
        (
            types.ImageChunk(data=jpeg(40, 40), format="png", expected_tokens=4),
            "is 'png' but the data is a JPEG",
        ),
        (
            types.ImageChunk(data=PNG, format="png", expected_tokens=5),
            f"expected_tokens is 5, but this 96x64 image is {PNG_TOKENS}",
        ),
        (types.ImageChunk(data=PNG, format="png", expected_tokens=PNG_TOKENS), NOT_SERVED),
        (
            types.ImageAssetPointerChunk(format="png", location="s3://b/x.png", expected_tokens=4),
            "trine fetches nothing",
        ),
        (types.DmelChunk(dmel=b"x" * 4), "audio (dmel) chunks are not supported"),
    ]
    for chunk, words in cases:
        with pytest.raises(Exception, match=words.replace("(", r"\(").replace(")", r"\)")):
            vl.sample(prompt(chunk), 1, params).result()
    text_only = sc.create_sampling_client(base_model=TEXT_MODEL).result()
    with pytest.raises(Exception, match="tiny-llama is a text-only model"):
        text_only.sample(
            prompt(types.ImageChunk(data=PNG, format="png", expected_tokens=6)), 1, params
        ).result()


def test_tinker_image_chunks_in_training(sc):
    from tinker import types

    tc = sc.create_lora_training_client(base_model=VL_MODEL, rank=4).result()

    def datum(image, n):
        chunks = [types.EncodedTextChunk(tokens=[1, 5]), image, types.EncodedTextChunk(tokens=[7])]
        return types.Datum(
            model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"target_tokens": [5] * n}
        )

    good = types.ImageChunk(data=PNG, format="png", expected_tokens=PNG_TOKENS)
    bad = types.ImageChunk(data=PNG[:200], format="png", expected_tokens=PNG_TOKENS)
    for d, words in (
        (datum(bad, 3 + PNG_TOKENS), r"data\[0\].model_input\[1\].data"),
        (datum(good, 3 + PNG_TOKENS), NOT_SERVED),
    ):
        with pytest.raises(Exception, match=words):
            tc.forward_backward([d], "cross_entropy").result()
    text_datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 6]), loss_fn_inputs={"target_tokens": [5, 6, 7]}
    )
    assert (
        tc.forward_backward([text_datum], "cross_entropy").result().metrics["loss:sum"] > 0
    )  # the run goes on


# ---------------------------------------------------------------------------- OpenAI
def chat(srv, model: str, *parts: dict) -> httpx.Response:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {srv.api_key}"},
        timeout=60,
    )


def image_url(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


PART = "messages[0].content[1].image_url"
BAD_CHAT = [  # (part, param, code, words)
    (
        image_url("https://example.com/cat.png"),
        f"{PART}.url",
        "unsupported_value",
        "only data: URLs are accepted",
    ),
    (image_url("data:image/png;base64,@@@"), f"{PART}.url", "invalid_value", "not standard base64"),
    (image_url("data:image/gif;base64,R0lG"), f"{PART}.url", "invalid_value", "data:image/png;base64,<data>"),
    (image_url(data_url(PNG), "low"), f"{PART}.detail", "unsupported_value", "'low' is not supported"),
    (image_url(data_url(jpeg(40, 40))), PART, "invalid_value", "is 'png' but the data is a JPEG image"),
    (image_url(data_url(bomb_png(20000))), PART, "invalid_value", "pixels"),
    (image_url(data_url(PNG)), PART, "unsupported_value", NOT_SERVED),
    (
        {"type": "input_audio", "input_audio": {}},
        "messages[0].content",
        "invalid_value",
        "part 1 is 'input_audio'",
    ),
]


@pytest.mark.parametrize("part,param,code,words", BAD_CHAT, ids=[b[3] for b in BAD_CHAT])
def test_openai_image_url_parts_are_read_and_refused_by_name(srv, part, param, code, words):
    before = usage_rows(srv)
    r = chat(srv, VL_MODEL, part)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code) and words in err["message"], err
    assert usage_rows(srv) == before


def test_openai_images_for_a_text_model_name_the_model(srv):
    r = chat(srv, TEXT_MODEL, image_url(data_url(PNG)))
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["param"] == PART and "tiny-llama is a text-only model" in err["message"]
    )


def test_openai_chat_template_places_each_image(srv, monkeypatch):
    """Two images: each placeholder the template renders becomes that image's tokens, in order."""
    from trine.server.openai import routes

    seen = []
    real = routes.chat_images

    def spy(g, prompt, model):
        seen.append(prompt)
        return real(g, prompt, model)

    monkeypatch.setattr(routes, "chat_images", spy)
    r = chat(
        srv,
        VL_MODEL,
        image_url(data_url(PNG)),
        {"type": "text", "text": "and"},
        image_url(data_url(png(32, 64))),
    )
    assert r.status_code == 400 and NOT_SERVED in r.json()["error"]["message"]
    assert seen and seen[0].count(IMAGE_TOKEN) == 2  # the template's one placeholder per image


# ---------------------------------------------------------------------------- no 500 on any input
def test_no_image_input_gets_a_500(srv, raw, samplers):
    """Mutated PNG and JPEG files and random bytes, as every plane's image: always a 4xx."""
    import random

    rng = random.Random(0)
    files = [PNG, jpeg(48, 48), png(33, 65, "RGBA")]
    blobs = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(8)]
    for f in files:
        for _ in range(6):
            b = bytearray(f)
            for _ in range(rng.randrange(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            blobs.append(bytes(b[: rng.randrange(len(b) // 2, len(b) + 1)]))
    for blob in blobs:
        for fmt in ("png", "jpeg"):
            r = raw.sample(samplers[VL_MODEL], sample_body([text(), image_chunk(blob, fmt)]))
            assert 400 <= r.status_code < 500, (r.status_code, r.text)
        r = chat(srv, VL_MODEL, image_url(data_url(blob)))
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert raw.sample(samplers[VL_MODEL], sample_body([text()])).status_code == 200
