"""Images on every plane (issue 47), through the official clients unmodified: PyTRIO's image chunks
(base64 in sample JSON, bytes in MessagePack events: sample, compute_logprobs, a forward_backward
whose target shape implies the image's token count), Tinker's `ImageChunk` (JSON samples, protobuf
training) and OpenAI's `image_url` data URLs sample and train on a tiny random `qwen3_5`
checkpoint with its vision tower, and meter their image tokens. Each bad image is a 4xx naming the
field with nothing queued or metered; an image for a text-only model is a 400 naming the model.

A third model, a tiny Llama served beside a qwen3_5 image processor (visionutil.py), reads its
images against a real `VisionSpec` but its engine has no vision tower: a valid image is a 400
`not_supported` saying it does not serve images."""

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

TEXT_MODEL, VL_MODEL, UNSERVED = "tiny-llama", "tiny-qwen3_5-vl", "tiny-vl"  # names: their directories'
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
def srv(tiny_model_dir, tiny_vl_dir, tiny_vision_frontend_dir, tmp_path_factory):
    models = {TEXT_MODEL: tiny_model_dir, VL_MODEL: tiny_vl_dir, UNSERVED: tiny_vision_frontend_dir}
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
    return {m: raw.sampling_run(session, m) for m in (TEXT_MODEL, VL_MODEL, UNSERVED)}


def usage(srv) -> list:
    key = srv.service.authenticate(srv.api_key)
    return srv.service.store.usage_events(key.id)


def usage_rows(srv) -> int:
    return len(usage(srv))


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
    r = raw.sample(samplers[VL_MODEL], sample_body([text(1, IMAGE_TOKEN, 5)]))  # no image at all
    assert_refused(r, f"prompt: a text chunk holds the image placeholder id {IMAGE_TOKEN}")


def test_a_multi_picture_jpeg_samples_on_every_plane(srv, raw, samplers):
    """An MPO file (a JPEG with more pictures, as phones write) is a JPEG: it samples, where it once
    left the request unanswered (Pillow names its format "MPO")."""
    mpo = encoded(
        Image.new("RGB", (40, 40), (9, 99, 9)),
        "MPO",
        save_all=True,
        append_images=[Image.new("RGB", (40, 40))],
    )
    r = raw.sample(samplers[VL_MODEL], sample_body([text(), image_chunk(mpo, "jpeg", expected=4)]))
    assert r.status_code == 200, r.text
    assert_refused(
        raw.sample(samplers[VL_MODEL], sample_body([text(), image_chunk(mpo)])), "but the data is a JPEG"
    )
    r = chat(srv, VL_MODEL, image_url(data_url(mpo, "image/jpeg")))
    assert r.status_code == 200, r.text


def test_pytrio_images_to_a_text_model_name_the_model(raw, samplers):
    r = raw.sample(samplers[TEXT_MODEL], sample_body([text(), image_chunk()]))
    assert_refused(r, "prompt.chunks.1: tiny-llama is a text-only model")


def test_pytrio_samples_a_png_and_a_jpeg_and_meters_their_tokens(srv, raw, samplers):
    """Two images in one prompt sample, and the usage row counts their vision tokens among the
    prefill tokens; the same prompt again is served them from the prefix cache."""
    jpeg_file, jpeg_tokens = jpeg(50, 70), 4  # 64 x 64 after resizing: 2 x 2 merge blocks
    chunks = [text(), image_chunk(expected=PNG_TOKENS), text(), image_chunk(jpeg_file, "jpeg"), text()]
    n_prompt = 3 + PNG_TOKENS + 3 + jpeg_tokens + 3
    for turn in range(2):
        before = usage_rows(srv)
        r = raw.sample(samplers[VL_MODEL], sample_body(chunks))
        assert r.status_code == 200 and len(r.json()["sequences"][0]["tokens"]) == 2, r.text
        (row,) = usage(srv)[before:]
        assert row.prefill + row.prefill_cached == n_prompt
        assert row.prefill_image + row.prefill_image_cached == PNG_TOKENS + jpeg_tokens
        if turn:  # all but the last prompt token came from the cache, images included
            assert row.prefill_image_cached == PNG_TOKENS + jpeg_tokens and row.prefill == 1


def test_pytrio_valid_images_for_a_model_without_a_tower_are_refused_as_not_served(srv, raw, samplers):
    before = usage_rows(srv)
    chunks = [text(), image_chunk(expected=PNG_TOKENS), text(), image_chunk(jpeg(50, 70), "jpeg")]
    body = assert_refused(raw.sample(samplers[UNSERVED], sample_body(chunks)), NOT_SERVED)
    assert body["code"] == "not_supported"
    ok = raw.sample(samplers[UNSERVED], sample_body([text(1, 5, 6, 7)]))  # text still samples
    assert ok.status_code == 200 and len(ok.json()["sequences"][0]["tokens"]) == 2, ok.text
    assert usage_rows(srv) == before + 1


def test_pytrio_prompt_logprobs_of_an_image_prompt(raw, samplers):
    """What pytrio's compute_logprobs sends (a one-token sample with prompt logprobs), with an image:
    one entry per prompt position, None where the target is an image token (and at the first)."""
    body = {**sample_body([text(1, 5), image_chunk(), text(7, 8)]), "return_prompt_logprobs": True}
    body["sampling_params"]["max_tokens"] = 1
    r = raw.sample(samplers[VL_MODEL], body)
    assert r.status_code == 200, r.text
    logprobs = r.json()["prompt_logprobs"]
    assert len(logprobs) == 2 + PNG_TOKENS + 2
    assert [i for i, x in enumerate(logprobs) if x is None] == [0, *range(2, 2 + PNG_TOKENS)]
    assert all(x < 0 for x in logprobs if x is not None)


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
def test_pytrio_training_images_are_checked_before_anything_runs(srv, raw, chunk, n, words):
    """Refused before the engine sees it: the event takes its index and fails naming the field
    (the official client's later events then go on)."""
    run, rid = raw.started_run(UNSERVED if NOT_SERVED in words else VL_MODEL, wait=False)
    eid = f"event_img{rid[-6:]}{n}"
    err = raw.refused(run, event(eid, "forward_backward", 2, image_datum(chunk, n), rid))
    assert all(w in err["message"] for w in words), err


def test_pytrio_trains_on_an_image(raw):
    """A MessagePack forward_backward with an image's raw bytes: the loss falls on the text targets
    (the image's positions' targets are ignored), and training goes on."""
    run, rid = raw.started_run(VL_MODEL)
    eid = f"event_fb{rid[-6:]}"
    assert raw.submit(
        run, event(eid, "forward_backward", 2, image_datum(image_chunk(PNG, b64=False), 9), rid)
    )
    ev = raw.wait(run, eid)
    assert ev["status"] == "succeeded", ev
    assert ev["result"]["metrics"]["token_count"] == 3  # the targets at 0, 7 and 8: text
    assert ev["result"]["metrics"]["loss_sum"] > 0


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


def test_the_official_pytrio_client_samples_scores_and_trains_on_images(srv):
    """pytrio 0.2.9 unmodified: a sample's ImageChunk; a training datum whose image's token count the
    client infers from the target shape, which trains, and one whose shape implies another count, a
    400 naming both. Its compute_logprobs refuses image chunks itself (the client's own check): the
    wire request it sends is served (`test_pytrio_prompt_logprobs_of_an_image_prompt`)."""
    with pytrio_env(srv.url, srv.api_key) as trio:
        client = trio.ServiceClient()
        try:
            sampler = client.create_sampling_client(base_model=VL_MODEL)
            prompt = trio.ModelInput(
                chunks=[
                    trio.types.EncodedTextChunk(tokens=[1, 5]),
                    trio.ImageChunk(data=PNG, format="png"),
                    trio.types.EncodedTextChunk(tokens=[7, 8]),
                ]
            )
            res = sampler.sample(prompt, 2, trio.SamplingParams(max_tokens=3, seed=1)).result()
            assert [len(s.tokens) for s in res.sequences] == [3, 3]
            with pytest.raises(Exception, match="compute_logprobs does not support image chunks"):
                sampler.compute_logprobs(prompt).result()
            tc = client.create_lora_training_client(base_model=VL_MODEL, rank=4)
            n = 4 + PNG_TOKENS  # the target shape implies the image's token count
            datum = trio.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": [5] * n})
            out = tc.forward_backward([datum], "cross_entropy").result()
            assert out.metrics["loss_sum"] > 0
            assert out.metrics["token_count"] == 4  # the text targets only
            tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
            # a refused event leaves the client's run unusable (its choice): a run of its own
            tc = client.create_lora_training_client(base_model=VL_MODEL, rank=4)
            datum = trio.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": [5] * (n + 2)})
            with pytest.raises(Exception, match=f"expected_tokens is {PNG_TOKENS + 2}"):
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
        (
            types.ImageAssetPointerChunk(format="png", location="s3://b/x.png", expected_tokens=4),
            "trine fetches nothing",
        ),
        (types.DmelChunk(dmel=b"x" * 4), "audio (dmel) chunks are not supported"),
    ]
    for chunk, words in cases:
        with pytest.raises(Exception, match=words.replace("(", r"\(").replace(")", r"\)")):
            vl.sample(prompt(chunk), 1, params).result()
    good = prompt(types.ImageChunk(data=PNG, format="png", expected_tokens=PNG_TOKENS))
    res = vl.sample(good, 3, types.SamplingParams(max_tokens=2, seed=3)).result()
    assert [len(s.tokens) for s in res.sequences] == [2, 2, 2]
    logprobs = vl.compute_logprobs(good).result()  # targets that are image tokens: None
    assert [i for i, x in enumerate(logprobs) if x is None] == [0, *range(2, 2 + PNG_TOKENS)]
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
    with pytest.raises(Exception, match=r"data\[0\].model_input\[1\].data"):
        tc.forward_backward([datum(bad, 3 + PNG_TOKENS)], "cross_entropy").result()
    out = tc.forward_backward([datum(good, 3 + PNG_TOKENS)], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
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


def test_openai_images_for_a_model_without_a_tower_are_refused_as_not_served(srv):
    before = usage_rows(srv)
    r = chat(srv, UNSERVED, image_url(data_url(PNG)))
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (PART, "unsupported_value")
    assert NOT_SERVED in err["message"] and usage_rows(srv) == before


def test_openai_chat_with_an_image_url(srv):
    """The official openai client, unmodified: a data: URL image answers, its vision tokens counted
    in the prompt's usage and metered as image tokens."""
    import openai

    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key)
    before = usage_rows(srv)
    content = [{"type": "text", "text": "What is this?"}, image_url(data_url(PNG))]
    out = client.chat.completions.create(
        model=VL_MODEL, messages=[{"role": "user", "content": content}], max_tokens=3
    )
    assert out.choices[0].message.content is not None and out.usage.completion_tokens == 3
    (row,) = usage(srv)[before:]
    assert row.prefill_image + row.prefill_image_cached == PNG_TOKENS
    assert out.usage.prompt_tokens == row.prefill + row.prefill_cached


def test_openai_reads_a_data_url_whose_scheme_and_media_type_are_upper_case(srv):
    """RFC 2397: a URL's scheme and a media type are case-insensitive (the data is as sent)."""
    url = "DATA:IMAGE/PNG;BASE64," + base64.b64encode(PNG).decode()
    r = chat(srv, VL_MODEL, {"type": "text", "text": "What is this?"}, image_url(url))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > PNG_TOKENS


def test_openai_text_that_holds_the_image_placeholder_is_refused(srv):
    """A placeholder is an image's: a vision model's chat text or prompt ids that hold one with no
    image_url part are a 400 naming the messages or the prompt, nothing metered."""
    before = usage_rows(srv)
    r = chat(srv, VL_MODEL, {"type": "text", "text": " <|image_pad|>"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and f"(id {IMAGE_TOKEN})" in err["message"]
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": VL_MODEL, "prompt": [1, IMAGE_TOKEN, 5], "max_tokens": 2},
        headers={"Authorization": f"Bearer {srv.api_key}"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
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
    assert r.status_code == 200, r.text
    assert seen and seen[0].count(IMAGE_TOKEN) == 2  # the template's one placeholder per image
    assert r.json()["usage"]["prompt_tokens"] == len(seen[0]) - 2 + PNG_TOKENS + 2  # 64x32: 2 tokens


# ---------------------------------------------------------------------------- no 500 on any input
def test_no_image_input_gets_a_500(srv, raw, samplers):
    """Mutated PNG and JPEG files and random bytes, as every plane's image: a 4xx, or a sample where
    the mutation left a valid image (JPEG decoders are lenient), never a 500."""
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
            assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
        r = chat(srv, VL_MODEL, image_url(data_url(blob)))
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    assert raw.sample(samplers[VL_MODEL], sample_body([text()])).status_code == 200
