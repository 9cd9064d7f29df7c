"""The trainer with images (issue 47) on a tiny random `qwen3_5` checkpoint and real PNG and JPEG files:
LoRA gradients with images in the batch equal peft's on transformers' `Qwen3_5ForConditionalGeneration`
(kind 3, tests/tolerance.py); shared-prefix training with images computes the plain path's math
(kind 3), sharing a GRPO group's image prompt once and never two images whose placeholders are
equal; the vision tower stays frozen."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_losses import randomize
from test_vision import IMAGES, hf_pixels, hf_vl, spec, vl_dir  # noqa: F401  (fixtures)
from tolerance import Rounding, assert_same_computation, fp64_model
from visionutil import IMAGE_TOKEN, VISION_END, VISION_START, png

from trine.engine.api import Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.config import TrainerConfig
from trine.engine.images import PromptImage, mask_image_targets, read_model_input
from trine.engine.model.multimodal import ImageEncoder
from trine.engine.model.vision import load_vision_tower
from trine.engine.model.weights import load_model
from trine.engine.trainer.trainer import Trainer

IMAGES["a2"] = (png(96, 128, seed=9), "png")  # image a's size (its placeholders), other pixels
COMPLETIONS = (5, 7, 9)


@pytest.fixture(scope="module")
def twins(vl_dir, spec):  # noqa: F811
    """(model, encoder) in fp32 and its fp64 twin."""
    tower32, tower64 = load_vision_tower(vl_dir), load_vision_tower(vl_dir, dtype=torch.float64)
    return (load_model(vl_dir, "cpu"), ImageEncoder(tower32, spec)), (
        fp64_model(vl_dir),
        ImageEncoder(tower64, spec),
    )


def image_datum(spec, names, completion, g, head=(1, 5, 6)):  # noqa: F811
    """A chat-like prompt with `names`' images and a completion: targets the next tokens (those
    predicting an image position ignored, as the planes do), random weights, logprobs, advantages."""
    pieces = [list(head)]
    for n in names:
        pieces += [[VISION_START], PromptImage(*IMAGES[n]), [VISION_END, 7, 8]]
    tokens, images = read_model_input(pieces + [list(completion)], spec, "tiny", "datum")
    n = len(tokens)
    targets = mask_image_targets(tokens[1:] + [int(torch.randint(0, 49000, (1,), generator=g))], images)
    return TrainDatum(
        tokens=tokens,
        target_tokens=targets,
        weights=torch.randn(n, generator=g).tolist(),
        logprobs=(-torch.rand(n, generator=g) * 12 - 9).tolist(),
        advantages=torch.randn(n, generator=g).tolist(),
        images=images or None,
    )


def vision_data(spec, seed: int) -> list[TrainDatum]:  # noqa: F811
    """A GRPO group over image a (three completions), the same prompt with image a2 (equal
    placeholders, other pixels), a datum with a JPEG and a transparent PNG, and a text datum."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, 49000, (n,), generator=g).tolist()

    group = [image_datum(spec, ["a"], rand(k), g) for k in COMPLETIONS]
    twin = image_datum(spec, ["a2"], rand(6), g)
    text = rand(14)
    plain_text = TrainDatum(
        text,
        text[1:] + [3],
        weights=torch.randn(14, generator=g).tolist(),
        logprobs=(-torch.rand(14, generator=g) * 12 - 9).tolist(),
        advantages=torch.randn(14, generator=g).tolist(),
    )
    return group[:2] + [twin, image_datum(spec, ["b", "c"], rand(4), g), plain_text, group[2]]


def trainer(pair, sharing: bool = True) -> Trainer:
    model, enc = pair
    cfg = TrainerConfig(prefix_sharing=sharing, min_shared_tokens=4, logits_chunk_tokens=7)
    t = Trainer(model, base_model="tiny", config=cfg, encoder=enc)
    t.create_run("r", LoRAConfig(rank=4, alpha=8.0))
    randomize(t.adapter("r"), 3)
    return t


def grads(t: Trainer) -> torch.Tensor:
    """Every LoRA gradient, as one vector: on this random checkpoint the gradient of layer 1's
    `in_proj_a` is 1e-6 of the others (its gates barely move), so its own fp32 rounding, relative
    to itself, is 1e-2: not a scale to measure each tensor's rounding against."""
    return torch.cat([p.grad.flatten() for _, p in t.adapter("r").named_parameters()])


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_shared_prefixes_with_images_equal_the_plain_path(twins, spec, loss):  # noqa: F811
    """The group's image prompt is computed once; the datum with image a2 shares none of it (its
    placeholders are equal, its image is not); logprobs, losses and gradients are the plain path's."""
    data = vision_data(spec, 1)
    entry = [("r", Forward(data, Loss.parse(loss)))]
    image = data[0].images[0]
    prompt = image.offset + image.tokens + 3  # the group's shared prompt
    assert len({len(d.tokens) for d in data}) == len(data)

    def compute(pair):
        shared, plain = trainer(pair), trainer(pair, sharing=False)
        a, b = shared.forward_backward(entry)[0], plain.forward_backward(entry)[0]
        assert b.usage.train_tokens == a.usage.sequence_tokens == sum(len(d.tokens) for d in data)
        # the group's other two datums read its prompt; the a2 datum and the b, c one share only
        # the text before the image with it (min_shared_tokens 4)
        assert a.usage.train_tokens == b.usage.train_tokens - 2 * prompt - 2 * image.offset
        assert a.token_count == b.token_count
        ours, ref = {"grads": grads(shared)}, {"grads": grads(plain)}
        ours["logprobs"], ref["logprobs"] = a.logprobs, b.logprobs
        ours["losses"], ref["losses"] = a.losses, b.losses
        return ref, ours

    assert_same_computation(compute, *twins)
    assert not any(p.requires_grad or p.grad is not None for p in twins[0][1].tower.parameters())


def test_lora_gradients_with_images_match_transformers_and_peft(vl_dir, hf_vl, spec, twins):  # noqa: F811
    """A LoRA on every linear of the language model, trained by cross entropy with weights on a
    batch of image and text datums (shared prefixes on): each LoRA gradient is peft's on
    transformers' model, each datum run alone there with its pixels (kind 3)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    data = vision_data(spec, 2)
    entry = [("r", Forward(data, Loss.parse("cross_entropy")))]
    ours = [trainer(pair) for pair in twins]
    for t in ours:
        t.forward_backward(entry)
    adapter = ours[0].adapter("r")
    names = sorted({m.rsplit(".", 1)[-1] for m in adapter.module_names()})
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=names))
    params = dict(peft_model.named_parameters())

    def key(module, which):  # our module names are the language model's, transformers' nest it
        name = module.replace("model.layers.", "model.language_model.layers.")
        return f"base_model.model.{name}.lora_{which}.default.weight"

    with torch.no_grad():
        for module in adapter.module_names():
            for which, p in zip("AB", adapter.pair(module)):
                params[key(module, which)].copy_(p)
    assert not any("visual" in n for n in params if "lora_" in n)  # the tower has no adapter
    for d in data:
        ids = torch.tensor([d.tokens])
        extra = {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
        if d.images:
            extra["pixel_values"], extra["image_grid_thw"] = hf_pixels(image_names(d))
        targets = torch.tensor(d.target_tokens)
        active = targets >= 0
        logits = peft_model(input_ids=ids, **extra).logits[0]
        logp = logits.float().log_softmax(-1)[active].gather(1, targets[active, None])[:, 0]
        (-(torch.tensor(d.weights)[active] * logp).sum()).backward()

    def flat(pair_grads):  # one vector, as `grads` says why
        return torch.cat([g.flatten() for m in adapter.module_names() for g in pair_grads(m)])

    got = flat(lambda m: [p.grad for p in adapter.pair(m)])
    got64 = flat(lambda m: [p.grad for p in ours[1].adapter("r").pair(m)])
    want = flat(lambda m: [params[key(m, w)].grad for w in "AB"])
    Rounding(got, got64).assert_within(want)


def image_names(d: TrainDatum) -> list[str]:
    """The names (in IMAGES) of a datum's images, in order."""
    by_data = {data: name for name, (data, _) in IMAGES.items()}
    return [by_data[im.data] for im in d.images]


def test_images_are_checked_against_the_model(twins, spec, tiny_qwen3_5_dir):  # noqa: F811
    g = torch.Generator().manual_seed(0)
    d = image_datum(spec, ["a"], [20, 21], g)
    text_only = Trainer(load_model(tiny_qwen3_5_dir, "cpu"), base_model="tiny")
    text_only.create_run("r", LoRAConfig(rank=4))
    with pytest.raises(ValueError, match=r"batch\[0\].data\[0\]: tiny does not take images"):
        text_only.forward_backward([("r", Forward([d], Loss.parse("cross_entropy")))])
    moved = dataclasses.replace(d, images=(dataclasses.replace(d.images[0], offset=0),))
    t = trainer(twins[0])
    with pytest.raises(ValueError, match="must be exactly at the images' positions"):
        t.forward_backward([("r", Forward([moved], Loss.parse("cross_entropy")))])
