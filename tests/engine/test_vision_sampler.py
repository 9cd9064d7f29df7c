"""The sampler with images (issue 47), on a tiny random `qwen3_5` checkpoint and real PNG and JPEG files:
greedy tokens, sampled and prompt logprobs equal transformers' `Qwen3_5ForConditionalGeneration`
(`generate` for the tokens; kind 3, tests/tolerance.py), alone and batched with a text prompt; a
cached image prefix (a chat's next turn, a group's samples) serves what a fresh prefill computes
(kind 3 against a sampler without a prefix cache), encoding the image once; two images with equal
placeholders never share a cache entry; image tokens are metered, cached or computed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sampler import req
from test_vision import IMAGES, hf_pixels, hf_vl, spec, vl_dir  # noqa: F401  (fixtures)
from tolerance import Rounding, assert_same_samples, fp64_model
from visionutil import IMAGE_TOKEN, VISION_END, VISION_START, png

from trine.engine.config import SamplerConfig
from trine.engine.images import PromptImage, read_model_input
from trine.engine.model.multimodal import ImageEncoder
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.vision import load_vision_tower
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

MB = 2**20


@pytest.fixture(scope="module")
def twins(vl_dir, spec):  # noqa: F811
    """(model, tokenizer, encoder) in fp32 and its fp64 twin."""
    tok = Tokenizer(vl_dir)
    m32 = (load_model(vl_dir, "cpu"), tok, ImageEncoder(load_vision_tower(vl_dir), spec))
    tower64 = load_vision_tower(vl_dir, dtype=torch.float64)
    return m32, (fp64_model(vl_dir), tok, ImageEncoder(tower64, spec))


def make(mte, image_cache_bytes: int = MB, **kw) -> Sampler:
    """A sampler of its own (an empty prefix cache) on the shared model, with a fresh encoder cache."""
    model, tok, enc = mte
    kw.setdefault("kv_cache_bytes", 4 * MB)
    kw.setdefault("state_snapshot_tokens", 32)
    return Sampler(model, tok, SamplerConfig(**kw), ImageEncoder(enc.tower, enc.spec, image_cache_bytes))


def image_prompt(spec, *names, head=(1, 5, 6), tail=(9, 10, 11)):  # noqa: F811
    """Chat-like tokens: `head`, each image between its vision start and end tokens, then `tail`."""
    pieces = [list(head)]
    for i, n in enumerate(names):
        pieces += [[VISION_START], PromptImage(*IMAGES[n]), [VISION_END, 7 + i, 8]]
    return read_model_input(pieces + [list(tail)], spec, "tiny", "prompt")


def ask(tokens, images=(), max_tokens=6, **kw):
    return dataclasses.replace(req(tokens, max_tokens, **kw), images=tuple(images))


def flat(results, field="logprobs") -> list[float]:
    return [x for r in results for s in r.sequences for x in getattr(s, field)]


def tokens_of(results) -> list[list[int]]:
    return [s.tokens for r in results for s in r.sequences]


# ----------------------------------------------------------------------------- against transformers
@pytest.fixture(scope="module")
def cases(spec):  # noqa: F811
    """Two image prompts (a PNG; a JPEG and a transparent PNG) and a text prompt."""
    return [image_prompt(spec, "a"), image_prompt(spec, "b", "c"), (list(range(300, 327)), ())]


@pytest.fixture(scope="module")
def hf_reference(hf_vl, cases):  # noqa: F811
    """transformers' greedy tokens (8), their logprobs and the prompt logprobs at text targets."""
    out = []
    for (tokens, _), names in zip(cases, (["a"], ["b", "c"], [])):
        ids = torch.tensor([tokens])
        extra = {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
        if names:
            extra["pixel_values"], extra["image_grid_thw"] = hf_pixels(names)
        with torch.no_grad():
            gen = hf_vl.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **extra,
            )
            got = gen.sequences[0, len(tokens) :].tolist()
            sampled = torch.log_softmax(torch.cat(gen.logits).double(), -1)
            sampled = sampled.gather(1, torch.tensor(got)[:, None])[:, 0]
            logits = hf_vl(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
            lp = torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        text = (ids[0, 1:] != IMAGE_TOKEN).nonzero()[:, 0]  # entries whose target is text
        out.append((got, sampled, lp[text], text + 1))
    return out


@pytest.mark.parametrize("batched", [False, True], ids=["each alone", "batched with text"])
def test_greedy_samples_and_prompt_logprobs_match_transformers(twins, cases, hf_reference, batched):
    """Greedy decoding is `generate` token for token (decode positions at index + rope delta), and
    the sampled and prompt logprobs are its log-softmax; the prompt logprobs at image positions are
    None. Image rows and a text row in one batch compute what each computes alone."""

    def ours(mte):
        reqs = [ask(t, ims, 8, temperature=0, prompt_logprobs=True) for t, ims in cases]
        res = make(mte).run(reqs) if batched else [make(mte).run([r])[0] for r in reqs]
        got = {"sampled": [], "prompt": []}
        for r, (want_tokens, _, _, text), (tokens, _) in zip(res, hf_reference, cases):
            assert r.sequences[0].tokens == want_tokens
            image_at = [i for i, t in enumerate(tokens) if t == IMAGE_TOKEN]
            assert [i for i, x in enumerate(r.prompt_logprobs) if x is None] == [0] + image_at
            got["sampled"].append(torch.tensor(r.sequences[0].logprobs))
            got["prompt"].append(torch.tensor([r.prompt_logprobs[i] for i in text.tolist()]))
        return {k: torch.cat(v) for k, v in got.items()}

    m32, m64 = twins
    want = {"sampled": torch.cat([s for _, s, _, _ in hf_reference])}
    want["prompt"] = torch.cat([p for _, _, p, _ in hf_reference])
    Rounding(ours(m32), ours(m64)).assert_within(want)


# ----------------------------------------------------------------------------- the prefix cache
def test_a_chats_next_turn_reuses_the_images_encoding_and_kv(twins, spec):  # noqa: F811
    """Turn 2 (turn 1's prompt, its reply, a new question) is served the image's KV and state from
    the cache, encodes nothing, and samples what a sampler without a prefix cache samples (kind 3);
    its usage counts the image's tokens as cached."""
    tokens, images = image_prompt(spec, "a")
    n_image = images[0].tokens
    encodes = []

    def compute(mte):
        hot, cold = make(mte), make(mte, enable_prefix_cache=False)
        first = [s.run([ask(tokens, images, 5, temperature=0)])[0] for s in (hot, cold)]
        assert tokens_of(first[:1]) == tokens_of(first[1:])
        turn2 = tokens + first[0].sequences[0].tokens + [20, 21, 22]
        second = [s.run([ask(turn2, images, 5, temperature=0)])[0] for s in (hot, cold)]
        u = second[0].usage
        assert u.cached_tokens >= images[0].offset + n_image and u.cached_image_tokens == n_image
        assert u.image_tokens == 0 and u.prompt_tokens == u.prefill_tokens + u.cached_tokens
        assert second[1].usage.image_tokens == n_image and second[1].usage.cached_image_tokens == 0
        encodes.append(hot.stats["image_encodes"])
        assert tokens_of(second[:1]) == tokens_of(second[1:])
        return {"turn 2": flat(second[1:])}, {"turn 2": flat(second[:1])}, tokens_of(second[:1])

    assert_same_samples(compute, *twins)
    assert encodes == [1, 1]  # turn 1 encoded the image; turn 2 read its KV


def test_a_group_over_one_image_encodes_and_prefills_it_once(twins, spec):  # noqa: F811
    """A GRPO group: 4 samples of one request prefill the prompt once; 4 requests with the same
    prompt sent together prefill it once between them (the others wait for its blocks, then hit)
    and encode the image once. Seeded samples equal a sampler without a prefix cache (kind 3)."""
    tokens, images = image_prompt(spec, "b")
    n = len(tokens)

    def compute(mte):
        s, cold = make(mte), make(mte, enable_prefix_cache=False)
        group = ask(tokens, images, 4, n=4, seed=7)
        (one,) = s.run([group])
        assert one.usage.prefill_tokens == n and one.usage.image_tokens == images[0].tokens
        apart = [ask(tokens, images, 4, seed=7 + i) for i in range(4)]
        together = s.run(apart)
        u = [r.usage for r in together]
        assert all(x.cached_image_tokens == images[0].tokens for x in u)  # the group's KV served them
        assert s.stats["image_encodes"] == 1 and s.stats["image_tokens"] == images[0].tokens
        ref = cold.run(
            [dataclasses.replace(group, request_id="c0")]
            + [dataclasses.replace(r, request_id=f"c{i + 1}") for i, r in enumerate(apart)]
        )
        return {"lp": flat(ref)}, {"lp": flat([one] + together)}, tokens_of(ref) + tokens_of([one] + together)

    def checked(mte):
        ref, path, chosen = compute(mte)
        half = len(chosen) // 2
        assert chosen[:half] == chosen[half:]
        return ref, path, chosen[:half]

    assert_same_samples(checked, twins[0], twins[1])


def test_equal_placeholders_of_two_images_share_no_cache_entry(twins, spec):  # noqa: F811
    """Two images of one size have the same placeholder ids: the second prompt is served nothing of
    the first one's image (nor of the text after it), and samples what a fresh sampler samples."""
    other = png(96, 128, seed=9)  # image "a"'s size, other pixels
    first = image_prompt(spec, "a")
    pieces = [[1, 5, 6], [VISION_START], PromptImage(other, "png"), [VISION_END, 7, 8], [9, 10, 11]]
    second = read_model_input(pieces, spec, "tiny", "prompt")
    assert first[0] == second[0] and first[1][0].content_hash != second[1][0].content_hash
    m32, _ = twins
    s = make(m32)
    s.run([ask(*first, 4, temperature=0)])
    (got,) = s.run([ask(*second, 4, temperature=0)])
    assert got.usage.cached_tokens <= second[1][0].offset and got.usage.cached_image_tokens == 0
    assert s.stats["image_encodes"] == 2
    (fresh,) = make(m32).run([ask(*second, 4, temperature=0)])
    assert tokens_of([got]) == tokens_of([fresh])


def test_a_chunk_may_cut_through_an_image(twins, spec):  # noqa: F811
    """Prefill chunks of 8 positions cut both images of a prompt: each image is encoded once (the
    request holds its features: the encoder here keeps none), and the samples are what a
    whole-prompt prefill gives (kind 3)."""
    tokens, images = image_prompt(spec, "a", "b")

    def compute(mte):
        whole = make(mte)
        chunked = make(mte, image_cache_bytes=0, max_batch_tokens=8, min_prefill_tokens=8)
        r = ask(tokens, images, 5, temperature=0, prompt_logprobs=True)
        res = [s.run([dataclasses.replace(r, request_id=f"x{i}")])[0] for i, s in enumerate((whole, chunked))]
        assert chunked.stats["prefill_forwards"] > 3 and chunked.stats["image_encodes"] == 2

        def values(x):
            return flat([x]) + [v for v in x.prompt_logprobs if v is not None]

        return {"lp": values(res[0])}, {"lp": values(res[1])}, tokens_of(res[:1]) + tokens_of(res[1:])

    def checked(mte):
        ref, path, chosen = compute(mte)
        assert chosen[0] == chosen[1]
        return ref, path, chosen[:1]

    assert_same_samples(checked, twins[0], twins[1])


# ----------------------------------------------------------------------------- checks
def test_images_are_checked_against_the_model(twins, spec, tiny_qwen3_5_dir):  # noqa: F811
    tokens, images = image_prompt(spec, "a")
    text_only = Sampler(load_model(tiny_qwen3_5_dir, "cpu"), Tokenizer(tiny_qwen3_5_dir))
    with pytest.raises(ValueError, match="prompt: tiny does not take images"):
        text_only.add(ask(tokens, images))
    s = make(twins[0])
    moved = (dataclasses.replace(images[0], offset=images[0].offset + 1),)
    with pytest.raises(ValueError, match="placeholder id 49152 must be exactly at the images' positions"):
        s.add(ask(tokens, moved))
    with pytest.raises(ValueError, match=r"prompt.images\[0\]: its span"):
        s.add(ask(tokens[:10], images))
    assert not s.has_work()


def test_only_a_checkpoint_with_its_tower_serves_images(tiny_vl_dir, tmp_path):
    """The engine's encoder needs a qwen3_5 language model and the tower's weights: a directory
    with the language model alone (a full fine-tuning run's weights) serves text, its images refused
    by the planes as not served."""
    import shutil

    from safetensors.torch import load_file, save_file

    from trine.engine.model.multimodal import load_image_encoder

    model = load_model(tiny_vl_dir, "cpu")
    enc = load_image_encoder(tiny_vl_dir, model)
    assert enc is not None and enc.spec.served and enc.tower.dtype == model.dtype
    text_only = tmp_path / "language-model-only"
    shutil.copytree(tiny_vl_dir, text_only)
    for f in text_only.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if ".visual." not in f".{k}"}, f)
    assert load_image_encoder(text_only, load_model(text_only, "cpu")) is None
