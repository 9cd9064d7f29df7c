"""OpenAI-compatible API benchmark: what the OpenAI front end costs, and the cache in a chat.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU, one
server; the official `openai` client.

1. Front-end overhead: the same group request (a `--prompt`-token prompt of token ids, `n=--samples`,
   `--new` new tokens, seeded) through `/v1/completions` (whole and streamed) vs the PyTRIO actor
   plane's sample route. Paths interleaved in rotating order, a fresh random prompt for every call
   (no path gets cache hits another does not), `--repeats` rounds after one warm-up round;
   ratios = median(OpenAI) / median(PyTRIO).
2. `--repeats` chats of `--turns` turns after a long system prompt, streamed through
   `/v1/chat/completions`: the share of each later turn's prompt reported as `cached_tokens`, and
   that turn's time to first token vs the same prompt (token ids) with its first token changed,
   sent right after it, so that nothing of it is cached (medians).

3. Scoring (`--only scoring` runs it alone): `--questions` four-choice questions after one shared
   few-shot stem, as an evaluation harness's loglikelihood task sends them: batches of
   `--score-batch` token-id prompts (context + choice) with `echo`, `logprobs: 1`, `max_tokens: 0`,
   each choice scored by the sum of its tokens' logprobs; vs Hugging Face `transformers` scoring the
   same token ids in-process (fp32, same threads, batches of the same size, right-padded). Every
   round scores new questions (only the stem was seen before, as in a harness's task).
   `speedup` = transformers seconds / trine seconds (medians over `--repeats`); also the largest
   score difference, the chosen answers' agreement (worst round), and the cached share of the
   prompts: the OpenAI plane keeps prompt scores with their KV blocks, so the stem, and a
   question's text for its later choices, are scored once and served from the prefix cache.

    .venv/bin/python benchmarks/openai_api.py [--repeats 5] [--turns 4] [--json] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import httpx
import openai
from report import record  # benchmarks/report.py
from service import Wire, log  # benchmarks/service.py: the PyTRIO wire client

from trine.engine.config import EngineConfig
from trine.server.app import start_server

SYSTEM = (
    "You are a meticulous travel planner. For every request, list the days, the distances, "
    "where to sleep and what to eat, and mention the weather risks of the season. Keep each "
    "day to three sentences. "
) * 6
QUESTIONS = [
    "Plan three days of walking in the Lake District.",
    "Make the second day shorter.",
    "Add a rainy-day alternative.",
    "Where should I stay the last night?",
]


def bench_overhead(client: openai.OpenAI, wire: Wire, name: str, args) -> dict:
    srun = wire.sampler(name)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"pytrio": [], "openai": [], "openai_stream": []}
    paths = list(times)
    for rep in range(args.repeats + 1):  # round 0 warms every path up and is dropped
        for path in paths[rep % 3 :] + paths[: rep % 3]:
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
            t = time.perf_counter()
            if path == "pytrio":
                out = wire.sample(
                    srun,
                    {
                        "request_id": f"req_{rep}",
                        "num_samples": args.samples,
                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                        "sampling_params": {
                            "max_tokens": args.new,
                            "temperature": 1.0,
                            "seed": 1,
                            "stop_token_ids": [],
                        },
                    },
                )
                assert len(out["sequences"]) == args.samples
            else:
                kw = dict(
                    model=name,
                    prompt=prompt,
                    n=args.samples,
                    max_tokens=args.new,
                    temperature=1.0,
                    seed=1,
                    extra_body={"stop_token_ids": []},
                )
                if path == "openai":
                    assert len(client.completions.create(**kw).choices) == args.samples
                else:
                    chunks = list(client.completions.create(**kw, stream=True))
                    assert len(chunks) >= args.samples
            if rep:
                times[path].append(time.perf_counter() - t)
    med = {p: statistics.median(v) * 1000 for p, v in times.items()}
    log(
        f"group of {args.samples}x{args.new} tokens, {args.prompt}-token prompt (medians of {args.repeats}): "
        + ", ".join(f"{p} {ms:.0f} ms" for p, ms in med.items())
    )
    return {
        **{f"{p}_ms": ms for p, ms in med.items()},
        "openai_vs_pytrio": med["openai"] / med["pytrio"],
        "openai_stream_vs_pytrio": med["openai_stream"] / med["pytrio"],
    }


def first_token_seconds(create, **kw) -> tuple[float, str, object]:
    """Stream `create(**kw)`: (seconds to the first generated text, the whole text, the usage)."""
    t, first, text, usage = time.perf_counter(), None, "", None
    for chunk in create(**kw, stream=True):
        if chunk.usage is not None:
            usage = chunk.usage
        piece = (
            (chunk.choices[0].delta.content if hasattr(chunk.choices[0], "delta") else chunk.choices[0].text)
            if chunk.choices
            else None
        )
        if first is None and (piece or (chunk.choices and chunk.choices[0].finish_reason)):
            first = time.perf_counter() - t
        text += piece or ""
    return first, text, usage


def bench_chat(client: openai.OpenAI, name: str, model_dir: Path, args) -> dict:
    from transformers import AutoTokenizer  # the server applies the same template (tested)

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    shares, warm, cold = [], [], []
    for rep in range(args.repeats):
        messages = [{"role": "system", "content": f"Session {rep}. {SYSTEM}"}]  # a new chat each time
        for turn, q in enumerate(QUESTIONS[: args.turns]):
            messages.append({"role": "user", "content": q})
            first, text, usage = first_token_seconds(
                client.chat.completions.create,
                model=name,
                messages=messages,
                max_tokens=args.answer,
                temperature=0,
                stream_options={"include_usage": True},
            )
            if turn:
                shares.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
                warm.append(first)
                ids = list(
                    tok.apply_chat_template(
                        messages, add_generation_prompt=True, tokenize=True, return_dict=False
                    )
                )
                assert len(ids) == usage.prompt_tokens
                other = [100 + (ids[0] + 1 + rep) % 40000] + ids[1:]  # nothing of it is cached
                cold.append(
                    first_token_seconds(
                        client.completions.create, model=name, prompt=other, max_tokens=1, temperature=0
                    )[0]
                )
            messages.append({"role": "assistant", "content": text})
    out = {
        "cached_share_turns_2_on": round(statistics.median(shares), 3),
        "ttft_cached_ms": statistics.median(warm) * 1000,
        "ttft_uncached_ms": statistics.median(cold) * 1000,
    }
    out["ttft_speedup"] = out["ttft_uncached_ms"] / out["ttft_cached_ms"]
    log(
        f"chat, turns 2-{args.turns} of {args.repeats} chats: median cached share "
        f"{out['cached_share_turns_2_on']:.1%}, TTFT {out['ttft_cached_ms']:.0f} ms vs "
        f"{out['ttft_uncached_ms']:.0f} ms with nothing cached"
    )
    return out


STEM = (
    "The following are multiple choice questions about general knowledge. Answer each with the "
    "single best choice.\n\nQuestion: What is the boiling point of water at sea level?\n"
    "Answer: 100 degrees Celsius\n\nQuestion: Which gas do plants take in?\nAnswer: carbon dioxide\n\n"
)
SUBJECTS = ["river", "mountain", "city", "forest", "desert", "island", "lake", "valley"]
CHOICES = [" the first one", " the second one", " the third one", " the fourth one"]


def scoring_items(tok, questions: int, first: int = 0) -> list[tuple[list[int], list[int]]]:
    """(context ids, choice ids) for every choice of questions first..first + questions - 1; the
    stem is shared by all of them, each question's text by its four choices."""
    items = []
    for q in range(first, first + questions):
        text = f"{STEM}Question: Which {SUBJECTS[q % 8]} is number {q} on the list?\nAnswer:"
        ctx = tok.encode(text, add_special_tokens=True)
        items += [(ctx, tok.encode(c, add_special_tokens=False)) for c in CHOICES]
    return items


def bench_scoring(client: openai.OpenAI, name: str, model_dir: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def batches_of(round_: int) -> list[list[tuple[list[int], list[int]]]]:
        """Round r's questions: new ones every round (only the stem is ever seen before)."""
        items = scoring_items(tok, args.questions, round_ * args.questions)
        return [items[i : i + args.score_batch] for i in range(0, len(items), args.score_batch)]

    def trine(batches) -> tuple[list[float], int, int]:
        scores, prompt, cached = [], 0, 0
        for batch in batches:
            r = client.completions.create(
                model=name, prompt=[c + x for c, x in batch], echo=True, logprobs=1, max_tokens=0
            )
            scores += [sum(ch.logprobs.token_logprobs[-len(x) :]) for ch, (_, x) in zip(r.choices, batch)]
            prompt += r.usage.prompt_tokens
            cached += r.usage.prompt_tokens_details.cached_tokens
        return scores, prompt, cached

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def hf(batches) -> list[float]:
        scores = []
        for batch in batches:
            seqs = [c + x for c, x in batch]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logp = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
            for b, (c, x) in enumerate(batch):
                pos = torch.arange(len(c) - 1, len(c) + len(x) - 1)
                scores.append(float(logp[b, pos, torch.tensor(x)].sum()))
        return scores

    trine(batches_of(0))  # warm-up, both
    hf(batches_of(0))
    t_trine, t_hf, diffs, agree, prompt, cached = [], [], [], [], 0, 0
    pick = lambda s: [max(range(4), key=lambda k: s[q * 4 + k]) for q in range(args.questions)]  # noqa: E731
    for r in range(1, args.repeats + 1):
        batches = batches_of(r)
        t = time.perf_counter()
        ours, p, c = trine(batches)
        t_trine.append(time.perf_counter() - t)
        t = time.perf_counter()
        theirs = hf(batches)
        t_hf.append(time.perf_counter() - t)
        prompt, cached = prompt + p, cached + c
        diffs.append(max(abs(a - b) for a, b in zip(ours, theirs)))
        agree.append(sum(a == b for a, b in zip(pick(ours), pick(theirs))) / args.questions)
    out = {
        "questions": args.questions,
        "prompts": 4 * args.questions,
        "trine_s": statistics.median(t_trine),
        "transformers_s": statistics.median(t_hf),
        "max_score_diff": max(diffs),
        "answers_agree": min(agree),
        "cached_share": cached / prompt,
    }
    out["speedup"] = out["transformers_s"] / out["trine_s"]
    log(
        f"scoring {out['prompts']} prompts ({args.questions} questions x 4): trine {out['trine_s']:.2f} s, "
        f"transformers {out['transformers_s']:.2f} s (x{out['speedup']:.2f}); max score diff "
        f"{out['max_score_diff']:.1e}, answers agree {out['answers_agree']:.0%}, "
        f"cached {out['cached_share']:.0%}"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer", type=int, default=48, help="tokens per chat answer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=64, help="four-choice questions to score")
    ap.add_argument("--score-batch", type=int, default=32, help="prompts per scoring request")
    ap.add_argument("--only", choices=["overhead", "chat", "scoring"], action="append")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    name = args.model.name
    with tempfile.TemporaryDirectory() as home:
        srv = start_server(
            {name: args.model}, home=home, engine=EngineConfig(num_threads=args.threads, device="cpu")
        )
        try:
            client = openai.OpenAI(
                base_url=srv.url + "/v1",
                api_key=srv.api_key,
                max_retries=0,
                http_client=httpx.Client(trust_env=False, timeout=600),
            )
            parts = args.only or ["overhead", "chat", "scoring"]
            result = {"model": name}
            if "overhead" in parts:
                result["overhead"] = bench_overhead(client, Wire(srv.url, srv.api_key), name, args)
            if "chat" in parts:
                result["chat"] = bench_chat(client, name, args.model, args)
            if "scoring" in parts:
                result["scoring"] = bench_scoring(client, name, args.model, args)
        finally:
            srv.stop()
    record(result)  # benchmarks/results/openai_api.jsonl
    print(json.dumps(result, indent=2) if args.json else result)


if __name__ == "__main__":
    main()
