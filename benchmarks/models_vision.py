"""A GRPO group over one image on Qwen3.5's vision-language shape: trine's sampler against transformers'
`generate` on the same random weights (issue 47, item 7), fp32 on CPU.

    .venv/bin/python benchmarks/models_vision.py [--json] [--quick] [--repeats 3] [--model-dir DIR]

The model: Qwen3.5-0.8B's text stack (benchmarks/models.py's `QWEN3_5_0_8B`) with transformers'
default Qwen3.5 vision tower (`Qwen3_5VisionConfig()`: 27 blocks of width 1152, patch 16, merge 2;
its output projected to the text width), random weights, built once as a `qwen3_5` checkpoint with
a `preprocessor_config.json` (Qwen3.5's: mean and std 0.5). The prompt: a chat turn of 24 text
tokens around one 448 x 448 PNG (196 vision tokens), 32 new tokens per sample.

Keys (medians over `--repeats`, each repeat's sides interleaved on a fresh picture):
- `vision_group_vs_hf`: HF seconds / trine seconds for a group of 8 samples: trine one request of
  `num_samples` 8 (the image encoded and the prompt prefilled once) against
  `generate(num_return_sequences=8)`. The goal: >= 3.
- `vision_group_prefill_cached_fraction`: the same group sent as 8 requests of one sample each, at
  once: the share of their prompt tokens the prefix cache served (the first request computes the
  image's KV, the others are served it: images are keyed by content). The goal: >= 0.8.
- `vision_encoder_s` / `vision_encoder_hf_s`: one encoding of the image by trine's tower and by
  transformers' (`model.visual`); `vision_encodes` (trine's encodings in a repeat: 1),
  `vision_prefill_computed_tokens` / `vision_prefill_cached_tokens` of the 8 requests,
  `vision_image_tokens`, and the seconds behind the ratios.

`--quick`: a 4-layer text shape and a 2-block tower, 4 new tokens, one repeat: a smoke run (its
figures mean nothing). benchmarks/models.py runs this file's `run` as its `vision` part.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from models import QUICK_SHAPE, QWEN3_5_0_8B, TOKENIZER, W, load_engine_model, log  # benchmarks/models.py
from PIL import Image, ImageDraw
from report import emit  # benchmarks/report.py

from trine.engine.api import SampleRequest, SamplingOptions
from trine.engine.config import SamplerConfig
from trine.engine.images import PromptImage, read_model_input
from trine.engine.model.multimodal import load_image_encoder
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.sampler.sampler import Sampler


def vision_token_ids(vocab: int) -> dict:
    """The image placeholder and vision start / end ids: Qwen3.5's (248056, 248053, 248054 of its
    248,320), as far from the end of a smaller vocabulary."""
    return dict(
        image_token_id=vocab - 264, vision_start_token_id=vocab - 267, vision_end_token_id=vocab - 266
    )


PREPROCESSOR = {  # Qwen3.5's image processor settings
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
QUICK_VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, num_position_embeddings=256)
SIZES = dict(samples=8, side=448, head=12, tail=12, new=32)
QUICK = dict(SIZES, new=4)


def build_vl_dir(text: dict, vision: dict, out: Path) -> Path:
    """A random `qwen3_5` checkpoint (seed 0) of `text` and `vision` with Qwen3.5's image processor
    settings and a tokenizer; reused when `out` already holds one."""
    if (out / "config.json").is_file():
        return out
    import shutil

    import transformers as tf

    vision = {**vision, "out_hidden_size": text["hidden_size"]}
    cfg = tf.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=text.get("tie_word_embeddings", False),
        **vision_token_ids(text["vocab_size"]),
    )
    torch.manual_seed(0)
    tf.Qwen3_5ForConditionalGeneration(cfg).save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


def picture(rng: random.Random, side: int) -> bytes:
    """A PNG of a few coloured shapes (what examples/vision_grpo.py draws)."""
    image = Image.new("RGB", (side, side), "white")
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 5)):
        x, y, r = rng.randrange(side), rng.randrange(side), rng.randrange(side // 16, side // 4)
        pen.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class VisionBench:
    def __init__(self, model_dir: Path, p: dict, repeats: int):
        from transformers import Qwen3_5ForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model = load_engine_model(model_dir)
        self.encoder = load_image_encoder(model_dir, self.model)
        self.tok = Tokenizer(model_dir)
        self.spec = self.encoder.spec
        self.hf = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = Qwen2VLImageProcessorPil(**PREPROCESSOR)
        self.p, self.repeats = p, repeats
        self.rng = random.Random(0)
        self._n = 0

    def prompt(self):
        """(tokens, images, the PNG) of a chat-like prompt around a fresh picture."""
        vocab = self.model.cfg.vocab_size // 2
        text = [self.rng.randrange(100, vocab) for _ in range(self.p["head"] + self.p["tail"])]
        png = picture(self.rng, self.p["side"])
        pieces = [text[: self.p["head"]] + [self.spec.vision_start_token_id], PromptImage(png, "png")]
        pieces.append([self.spec.vision_end_token_id] + text[self.p["head"] :])
        tokens, images = read_model_input(pieces, self.spec, "bench", "prompt")
        return tokens, images, png

    def req(self, tokens, images, n: int, seed: int) -> SampleRequest:
        self._n += 1
        opts = SamplingOptions(max_tokens=self.p["new"], temperature=1.0, seed=seed, stop_at_eos=False)
        return SampleRequest(f"v{self._n}", tokens, opts, W, num_samples=n, images=images)

    def sampler(self) -> Sampler:
        self.encoder.cache.clear()  # every repeat encodes its picture (a fresh one anyway)
        self.encoder.bytes = 0
        return Sampler(self.model, self.tok, SamplerConfig(), self.encoder)

    def hf_inputs(self, tokens, png: bytes) -> dict:
        pixels = self.processor([Image.open(io.BytesIO(png))], return_tensors="pt")
        ids = torch.tensor([tokens])
        return dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == self.spec.image_token_id).int(),
        )

    def generate(self, inputs: dict):
        new = self.p["new"]
        with torch.inference_mode():
            out = self.hf.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                num_return_sequences=self.p["samples"],
                pad_token_id=0,
            )
        assert out.shape == (self.p["samples"], inputs["input_ids"].shape[1] + new), out.shape

    def run(self) -> dict:
        k = self.p["samples"]
        t_trine, t_hf, t_enc, t_enc_hf, split, encodes = [], [], [], [], [], []
        for r in range(self.repeats):
            tokens, images, png = self.prompt()
            inputs = self.hf_inputs(tokens, png)

            def trine():
                s = self.sampler()
                seconds, misses = self.encoder.seconds, self.encoder.misses
                (res,) = s.run([self.req(tokens, images, k, seed=r)])
                assert res.usage.prefill_tokens == len(tokens)  # the prompt computed once
                t_enc.append(self.encoder.seconds - seconds)
                encodes.append(self.encoder.misses - misses)

            sides = [(trine, t_trine), (lambda: self.generate(inputs), t_hf)]
            for fn, times in sides[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            with torch.inference_mode():
                start = time.perf_counter()
                self.hf.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
                t_enc_hf.append(time.perf_counter() - start)
            s = self.sampler()  # the group as k requests of one sample, sent together
            results = s.run([self.req(tokens, images, 1, seed=100 * r + j) for j in range(k)])
            split.append([(x.usage.prefill_tokens, x.usage.cached_tokens) for x in results])
            log(f"  vision group #{r}: trine {t_trine[-1]:.2f}s  HF {t_hf[-1]:.2f}s")
        computed = sum(c for c, _ in split[-1])
        cached = sum(c for _, c in split[-1])
        trine, hf = statistics.median(t_trine), statistics.median(t_hf)
        return dict(
            vision_group_s=trine,
            vision_group_hf_s=hf,
            vision_group_vs_hf=hf / trine,
            vision_group_prefill_cached_fraction=cached / (computed + cached),
            vision_prefill_computed_tokens=computed,
            vision_prefill_cached_tokens=cached,
            vision_image_tokens=images[0].tokens,
            vision_encoder_s=statistics.median(t_enc),
            vision_encoder_hf_s=statistics.median(t_enc_hf),
            vision_encodes=max(encodes),
        )


def run(args, model_dir: Path | None = None) -> dict:
    """The figures (models.py's `vision` part): builds the checkpoint in `model_dir` (a temp dir)."""
    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="trine-vision-")
        model_dir = Path(tmp.name) / "qwen3_5-vl-random"
    try:
        text = QUICK_SHAPE if args.quick else QWEN3_5_0_8B
        build_vl_dir(text, QUICK_VISION if args.quick else {}, model_dir)
        bench = VisionBench(model_dir, QUICK if args.quick else SIZES, 1 if args.quick else args.repeats)
        warm = bench.prompt()  # allocator, kernels and the first forward's one-time costs
        bench.sampler().run([bench.req(warm[0], warm[1], 2, seed=0)])
        return bench.run()
    finally:
        if tmp is not None:
            tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one repeat: a smoke run")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--model-dir", type=Path, help="where the random checkpoint is built (default: a temp dir)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = dict(
        model="Qwen3.5-0.8B text + default vision tower (random)" if not args.quick else "quick shapes",
        repeats=1 if args.quick else args.repeats,
        threads=torch.get_num_threads(),
        quick=args.quick,
        sizes=QUICK if args.quick else SIZES,
    )
    out.update(run(args, args.model_dir))
    emit(out, args.json)


if __name__ == "__main__":
    main()
