"""GRPO with images: count the shapes in generated PNGs, rewarded when right; prints the reward curve.

    python examples/vision_grpo.py --model DIR [--steps 10] [--prompts 4] [--group 8] [--url URL]

DIR is a vision-language checkpoint (a Qwen3.5 one with its vision tower and its
preprocessor_config.json, e.g. a local copy of Qwen/Qwen3.5-0.8B); with --url, the name of such a
model on the server. Each step draws `--prompts` pictures with Pillow (one to five circles, squares
and triangles on a `--size` pixel canvas), asks how many shapes each holds, samples `--group`
replies per picture in ONE request (the image is encoded and prefilled once for the whole group),
rewards 1 when the first number in a reply is the count, and takes one `importance_sampling` step
on group-relative advantages with the sampler's own logprobs, each datum holding its picture. A
group whose rewards are all equal teaches nothing and is left out.
"""

from __future__ import annotations

import io
import random
import re
import statistics

from common import Phases, StepTimer, connect, parser
from PIL import Image, ImageDraw

import trine as trio

QUESTION = "How many shapes are in this picture? Reply with the number only."
COLOURS = ("red", "green", "blue", "orange", "purple", "black")
IMAGE_PAD = "<|image_pad|>"  # where the chat template places an image (Qwen's)


def draw(rng: random.Random, size: int) -> tuple[bytes, int]:
    """A PNG of one to five shapes that do not overlap, and how many it holds."""
    count = rng.randint(1, 5)
    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    cell = size // 3  # each shape in a cell of its own 3 x 3 grid
    for k in rng.sample(range(9), count):
        x, y = k % 3 * cell + cell // 8, k // 3 * cell + cell // 8
        box = (x, y, x + cell * 3 // 4, y + cell * 3 // 4)
        colour = rng.choice(COLOURS)
        shape = rng.choice(("circle", "square", "triangle"))
        if shape == "circle":
            pen.ellipse(box, fill=colour)
        elif shape == "square":
            pen.rectangle(box, fill=colour)
        else:
            pen.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), count


def image_prompt(tokenizer, png: bytes) -> trio.ModelInput:
    """The chat template's user turn with the picture, then the assistant's opening: the template's
    text around its image placeholder as tokens, the picture as an ImageChunk between them."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(IMAGE_PAD)
    return trio.ModelInput(
        chunks=[
            trio.EncodedTextChunk(tokens=tokenizer.encode(head, add_special_tokens=False)),
            trio.ImageChunk(data=png, format="png"),
            trio.EncodedTextChunk(tokens=tokenizer.encode(tail, add_special_tokens=False)),
        ]
    )


def policy_datum(
    prompt: trio.ModelInput, prompt_tokens: int, tokens: list[int], logprobs: list[float], advantage: float
) -> trio.Datum:
    """An importance_sampling datum of one reply to an image prompt of `prompt_tokens` positions (the
    image's vision tokens included): the prompt is not trained (target -100, advantage 0). The image's
    token count is left to the SDK, which reads it from the targets' length."""
    n = prompt_tokens - 1
    model_input = prompt.append(trio.EncodedTextChunk(tokens=tokens[:-1])) if len(tokens) > 1 else prompt
    return trio.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": [-100] * n + list(tokens),
            "logprobs": [0.0] * n + list(logprobs),
            "advantages": [0.0] * n + [advantage] * len(tokens),
        },
    )


def reward(text: str, count: int) -> float:
    m = re.search(r"\d+", text)
    return 1.0 if m and int(m.group()) == count else 0.0


def main(argv=None) -> dict:
    p = parser(__doc__, steps=10)
    p.add_argument("--prompts", type=int, default=4, help="Pictures (groups) per step.")
    p.add_argument("--group", type=int, default=8, help="Samples per picture, sent as one request.")
    p.add_argument("--size", type=int, default=224, help="Side of each picture in pixels.")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam's learning rate.")
    args = p.parse_args(argv)
    if args.model is None:
        p.error("--model: name a vision-language model (a Qwen3.5 checkpoint with its vision tower)")
    rng = random.Random(args.seed)
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, stop=["<|im_end|>", "\n"])
    curve = []
    with connect(args) as conn:
        service = conn.service
        phases = Phases(service)
        trainer = service.create_lora_training_client(
            base_model=conn.model, rank=16, seed=args.seed, name="vision-grpo", tags=["example", "grpo"]
        )
        tok = trainer.get_tokenizer()
        timer = StepTimer(service, args.steps)
        for step in range(args.steps):
            with phases("sample"):
                sampler = trainer.save_weights_and_get_sampling_client()
                pictures = [draw(rng, args.size) for _ in range(args.prompts)]
                prompts = [image_prompt(tok, png) for png, _ in pictures]
                futures = [
                    sampler.sample(pr, num_samples=args.group, sampling_params=params) for pr in prompts
                ]  # every group in flight at once
                data, rewards = [], []
                for (_, count), prompt, fut in zip(pictures, prompts, futures):
                    res = fut.result()
                    group = [reward(s.text or "", count) for s in res.sequences]
                    rewards += group
                    mean = statistics.fmean(group)
                    if any(r != mean for r in group):
                        data += [
                            policy_datum(prompt, res.input_tokens, s.tokens, s.logprobs, r - mean)
                            for s, r in zip(res.sequences, group)
                            if s.tokens
                        ]
            curve.append(statistics.fmean(rewards))
            trainer.log_metrics({"reward": curve[-1]}, step=step + 1)  # plotted in the console's run page
            line = f"step {step + 1:>3}  mean reward {curve[-1]:.3f}  "
            if data:
                with phases("train"):
                    fb = trainer.forward_backward(data, "importance_sampling")
                    opt = trainer.optim_step(trio.AdamParams(learning_rate=args.lr))
                    out, _ = fb.result(), opt.result()
                line += f"trained on {len(data)} samples, cycle {out.cycle}"
            else:
                line += "no reward variance in any group: no update"
            timer.done(line)
        print("reward curve: " + " ".join(f"{r:.2f}" for r in curve))
        phases.report()
    return {"reward_curve": curve}


if __name__ == "__main__":
    main()
