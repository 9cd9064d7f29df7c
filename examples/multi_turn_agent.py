"""A multi-turn tool-use loop, run twice: appending to the sampler's returned tokens, then
re-tokenizing the history as text. Prints both runs' prefix-cache hit rates and the diagnostic
trine's metering gives the second.

    python examples/multi_turn_agent.py [--conversations 8] [--turns 4] [--url URL] [--model DIR]

The agent is asked an arithmetic question and may call a calculator by writing `CALC: <expression>`;
the environment answers each turn with the result (or a reminder of the format) as the next
message. Each turn's prompt is the whole conversation so far.

- Run "append": the next prompt is the previous prompt + the tokens the sampler returned + the
  tokens of the new message. Every turn continues the previous one token for token, so the prefix
  cache serves the whole history (KV blocks filled while decoding are cached too).
- Run "retokenize": what agent code often does instead. Each reply is kept as a chat message
  (its text, trimmed), and every turn the whole history is rendered with the chat template and
  tokenized again. That text is the same conversation, but not always the same tokens: a sampled
  reply need not be in its tokenizer's canonical form (` \n` sampled, ` ` + `\n` on re-encoding),
  and trimming drops whitespace the model generated. From the first such token on, the prompt
  leaves the cached tokens and the rest is prefilled again; trine notices and reports it as
  `retokenized_history`, with the tokens it cost.

How often that happens depends on the model, the tokenizer and the temperature. On SmolLM2-135M
at temperature 1 it is a handful of the 24 turns that lead to another turn, mostly near a reply's
end, so the cost is small here; the diagnostic names each one. The script counts, in both runs,
the turns where the re-rendered history differs from the sampled tokens (in the first run they
cost nothing, since its prompts never re-render the history).
"""

from __future__ import annotations

import random
import re

from common import Phases, StepTimer, chat_tokens, connect, end_of_turn, parser

import trine as trio

SYSTEM = (
    "You are a careful assistant with a calculator. To use it, write CALC: followed by an "
    "arithmetic expression, e.g. CALC: 12*7. When you know the answer, write ANSWER: <number>."
)
EXPRESSION = re.compile(r"CALC:\s*([-+*/() .\d]+)")


def calculator(reply: str) -> str:
    """The tool: evaluates the first `CALC:` expression (digits and + - * / ( ) only)."""
    m = EXPRESSION.search(reply)
    if not m:
        return "No calculator call found. Write CALC: <expression>, or ANSWER: <number> when done."
    try:
        value = eval(m.group(1), {"__builtins__": {}}, {})  # noqa: S307 - the regex admits arithmetic only
    except (SyntaxError, ZeroDivisionError, TypeError):
        return f"CALC could not evaluate {m.group(1).strip()!r}."
    return f"CALC result: {value:g}" if isinstance(value, float) else f"CALC result: {value}"


def run(
    conn, tok, rng: random.Random, *, append: bool, conversations: int, turns: int, phases, timer: StepTimer
) -> dict:
    """One run of the loop on its own sampler (a line per conversation). Returns its token counts and
    hit rate."""
    sampler = conn.service.create_sampling_client(base_model=conn.model)
    eot = end_of_turn(tok)
    prompt_tokens = cached = diverged = 0
    with phases("append" if append else "retokenize"):
        for i in range(conversations):
            a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 9)
            history = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {a} * {c} + {b}?"},
            ]
            prompt = chat_tokens(tok, history, generation_prompt=True)
            for turn in range(turns):
                params = trio.SamplingParams(
                    max_tokens=32, temperature=1.0, stop=["<|im_end|>"], seed=rng.randrange(2**31)
                )  # the run repeats exactly
                res = sampler.sample(trio.ModelInput.from_ints(prompt), sampling_params=params).result()
                prompt_tokens += res.usage.prompt_tokens
                cached += res.usage.cached_tokens
                seq = res.sequences[0]
                reply = (seq.text or "").strip()  # as agent code keeps a message: trimmed text
                history += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": calculator(reply)},
                ]
                closed = seq.tokens if seq.tokens and seq.tokens[-1] == eot else seq.tokens + [eot]
                real = prompt + closed  # the tokens the server holds for this conversation so far
                retokenized = chat_tokens(tok, history, generation_prompt=True)
                if turn < turns - 1 and retokenized[: len(real)] != real:
                    diverged += 1  # re-tokenizing the history would leave the cached tokens here
                if append:
                    # the new message's tokens: the template's text after the history so far
                    done = tok.apply_chat_template(history[:-1], tokenize=False)
                    full = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
                    tail = done[
                        done.rindex("<|im_end|>") + len("<|im_end|>") :
                    ]  # what follows the reply's end
                    prompt = prompt + closed + tok.encode(tail + full[len(done) :], add_special_tokens=False)
                else:
                    prompt = retokenized
            timer.done(
                f"{'append' if append else 'retokenize':>10}: conversation {i + 1}/{conversations}, "
                f"{turns} turns, hit rate so far {100 * cached / max(prompt_tokens, 1):.1f}%"
            )
    report = conn.server_usage(sampler.sampling_run_id)
    return {
        "sampler": sampler.sampling_run_id,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "diverged_turns": diverged,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "diagnostics": [d["pattern"] for d in report["diagnostics"]],
        "diagnosed_requests": sum(
            d["requests"] for d in report["diagnostics"] if d["pattern"] == "retokenized_history"
        ),
        "report": report,
    }


def main(argv=None) -> dict:
    p = parser(__doc__, steps=None)
    p.add_argument("--conversations", type=int, default=8, help="Conversations in each of the two runs.")
    p.add_argument("--turns", type=int, default=4, help="Sampling turns per conversation.")
    args = p.parse_args(argv)
    with connect(args) as conn:
        phases = Phases(conn.service)
        tok = conn.service.create_sampling_client(base_model=conn.model).get_tokenizer()
        results = {}
        timer = StepTimer(conn.service, 2 * args.conversations, unit="conversation")
        for name, append in (("append", True), ("retokenize", False)):
            rng = random.Random(f"{args.seed}-{name}")  # different questions: no run reuses the other's cache
            results[name] = run(
                conn,
                tok,
                rng,
                append=append,
                conversations=args.conversations,
                turns=args.turns,
                phases=phases,
                timer=timer,
            )
        for name, r in results.items():
            print(
                f"{name:>10}: {r['prompt_tokens']:,} prompt tokens, "
                f"{r['cached_tokens']:,} from the prefix cache "
                f"(hit rate {100 * r['hit_rate']:.1f}%); at {r['diverged_turns']} turn(s) the re-tokenized "
                "history differs from the sampled tokens"
            )
            for d in r["report"]["diagnostics"]:
                print(
                    f"{'':>12}diagnostic {d['pattern']}: {d['requests']} request(s), {d['tokens_lost']:,} "
                    f"prompt tokens prefilled that could have been cached\n{'':>12}fix: {d['fix']}"
                )
            if not r["diagnostics"]:
                print(f"{'':>12}no cache diagnostics")
        phases.report()
    return {name: {k: v for k, v in r.items() if k != "report"} for name, r in results.items()}


if __name__ == "__main__":
    main()
