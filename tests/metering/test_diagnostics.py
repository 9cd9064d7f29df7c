"""Prefix-cache diagnostics on real SmolLM2 tokens: each fires on the bad practice, stays silent on the good
one."""

from __future__ import annotations

import pytest
from conftest import TOKENIZER_DIR

from trine.engine.model.tokenizer import Tokenizer
from trine.metering.diagnostics import PrefixDiagnostics
from trine.metering.rates import RateCard
from trine.metering.report import build_report

SYSTEM = (
    "You are a careful assistant for a travel agency. Answer questions about European capitals, "
    "train connections and museum opening hours. Keep answers short, cite the city, and never invent "
    "prices. If you do not know, say so plainly and suggest where the traveller could ask instead."
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOKENIZER_DIR)


def chat(*turns, system=SYSTEM):
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def observe(diag, tok, prompt, completions, run="r1", cached=0, key="k1"):
    return diag.observe(
        key, "s1", run, "SmolLM2-135M-Instruct", f"req{len(prompt)}", prompt, cached, completions, tok.decode
    )


def sampled(tok, *pieces):
    """A completion as a model may sample it: pieces tokenized separately (" Par" + "is" rather than
    " Paris"), ending with the EOS token <|im_end|>."""
    return [t for p in pieces for t in tok.encode(p)] + [tok.encode("<|im_end|>")[0]]


QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which one is larger?"]
ANSWERS = [(" The capital is", " Par", "is."), (" It is", " Ber", "lin."), (" Ber", "lin", " is larger.")]


def rebuilt_conversation(tok, answers):
    """Three turns whose prompts the user rebuilds from text and re-tokenizes each time: the
    diagnostics of each turn, its prompt, and its real tokens (prompt + completion)."""
    diag = PrefixDiagnostics()
    text = chat(("user", QUESTIONS[0]))
    prompt = tok.encode(text)
    found, prompts, reals = [], [], []
    for turn in range(3):
        completion = sampled(tok, *answers[turn])
        prompts.append(prompt)
        reals.append(prompt + completion)
        found.append(observe(diag, tok, prompt, [completion]))
        text = (
            text + tok.decode(completion) + f"\n<|im_start|>user\n{QUESTIONS[(turn + 1) % 3]}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        prompt = tok.encode(text)
        assert tok.decode(prompt).startswith(tok.decode(reals[-1]))
    return found, prompts, reals


def test_retokenized_history_fires(tok):
    found, prompts, reals = rebuilt_conversation(tok, ANSWERS)
    assert all(later[: len(real)] != real for later, real in zip(prompts[1:], reals))
    assert found[0] == []
    for turn in (1, 2):
        (d,) = found[turn]
        assert d.pattern == "retokenized_history"
        # " Par" + "is." re-tokenizes as " Paris" + ".": the prompt diverges right after the answer's first
        # piece
        previous = len(prompts[turn - 1]) + len(tok.encode(ANSWERS[turn - 1][0]))
        assert d.diverge_position == previous
        assert d.tokens_lost == len(reals[turn - 1]) - previous


def test_a_later_reply_that_re_tokenizes_differently_fires_though_earlier_ones_did_not(tok):
    """The prompt still extends an older turn's real tokens (that reply re-tokenized the same); the
    latest turn it continues is the one whose tokens it left."""
    found, prompts, reals = rebuilt_conversation(
        tok, [(" The capital is Paris.",), (" It is", " Ber", "lin."), (" Yes.",)]
    )
    assert prompts[1][: len(reals[0])] == reals[0] and prompts[2][: len(reals[1])] != reals[1]
    assert found[0] == [] and found[1] == []
    (d,) = found[2]
    assert d.pattern == "retokenized_history"


def test_history_rebuilt_with_trimmed_replies_fires(tok):
    """Agent code that stores `reply.strip()` and re-renders the chat: the text reads the same up to
    whitespace, the tokens leave the cache at the trimmed whitespace."""
    diag = PrefixDiagnostics()
    text = chat(("user", QUESTIONS[0]))
    prompt = tok.encode(text)
    reply = " The capital is Paris.\n\n"
    completion = tok.encode(reply) + [tok.encode("<|im_end|>")[0]]
    assert observe(diag, tok, prompt, [completion]) == []
    rebuilt = tok.encode(chat(("user", QUESTIONS[0]), ("assistant", reply.strip()), ("user", QUESTIONS[1])))
    (d,) = observe(diag, tok, rebuilt, [sampled(tok, " Berlin.")])
    assert d.pattern == "retokenized_history"
    assert d.diverge_position == len(prompt)  # the leading space was trimmed: the reply's first token differs
    assert d.tokens_lost == len(completion)
    # a different reply in its place is not the same history
    other = tok.encode(chat(("user", QUESTIONS[0]), ("assistant", "Rome."), ("user", QUESTIONS[1])))
    assert observe(PrefixDiagnostics(), tok, other, [[5]]) == []
    diag2 = PrefixDiagnostics()
    observe(diag2, tok, prompt, [completion])
    assert observe(diag2, tok, other, [sampled(tok, " Berlin.")]) == []


def test_appending_real_tokens_is_silent(tok):
    diag = PrefixDiagnostics()
    prompt = tok.encode(chat(("user", QUESTIONS[0])))
    for turn in range(3):
        completion = sampled(tok, *ANSWERS[turn])
        assert observe(diag, tok, prompt, [completion], cached=16 * (len(prompt) // 32)) == []
        if turn < 2:
            prompt = (
                prompt
                + completion
                + tok.encode(f"\n<|im_start|>user\n{QUESTIONS[turn + 1]}<|im_end|>\n<|im_start|>assistant\n")
            )


def test_varying_head_fires_and_fixed_first_is_silent(tok):
    users = [("2026-01-05", "u1842"), ("2026-01-06", "u77"), ("2026-01-07", "u90311")]
    diag = PrefixDiagnostics()
    hits = []
    for (date, uid), q in zip(users, QUESTIONS):
        system = f"Today is {date}, user id {uid}.\n{SYSTEM}"
        hits += observe(diag, tok, tok.encode(chat(("user", q), system=system)), [[tok.encode("Ok")[0]]] * 4)
    assert len(hits) == 2 and {d.pattern for d in hits} == {"varying_head"}
    head = len(tok.encode("<|im_start|>system\nToday is 2026-01-0"))
    n_system = len(tok.encode(SYSTEM))
    for d in hits:
        assert d.diverge_position == head
        assert n_system <= d.tokens_lost <= n_system + 10  # the system prompt and the template around it

    diag = PrefixDiagnostics()
    for (date, uid), q in zip(users, QUESTIONS):
        prompt = tok.encode(chat(("user", f"[{date}, user {uid}] {q}")))
        assert (
            observe(diag, tok, prompt, [[tok.encode("Ok")[0]]] * 4, cached=16 * (len(prompt) // 16 - 1)) == []
        )


def test_split_group_fires(tok):
    diag = PrefixDiagnostics()
    prompt = tok.encode(chat(("user", QUESTIONS[0])))
    assert observe(diag, tok, prompt, [sampled(tok, " Paris.")]) == []
    (d,) = observe(diag, tok, prompt, [sampled(tok, " Paris!")], cached=len(prompt) // 16 * 16)
    assert d.pattern == "split_group" and d.tokens_lost == len(prompt) % 16
    assert observe(diag, tok, prompt, [sampled(tok, "A")] * 4) == []  # one group: fine


def test_history_is_per_key_and_run_and_bounded(tok):
    diag = PrefixDiagnostics(history=2, max_runs=2)
    prompt = tok.encode(chat(("user", QUESTIONS[0])))
    observe(diag, tok, prompt, [[5]], run="r1", key="k1")
    assert observe(diag, tok, prompt, [[5]], run="r1", key="k2") == []  # another key: no shared history
    assert observe(diag, tok, prompt, [[5]], run="r2", key="k1") == []  # another run too
    observe(diag, tok, prompt, [[5]], run="r3", key="k1")  # evicts (k1, r1): least recently active
    assert len(diag._runs) == 2
    assert observe(diag, tok, prompt, [[5]], run="r1", key="k1") == []
    for i in range(5):
        observe(diag, tok, tok.encode(f"prompt {i}"), [[5]], run="r9")
    assert len(diag._runs[("k1", "r9")]) == 2


def test_report_names_patterns(tok):
    diag = PrefixDiagnostics()
    diags = []
    for date, q in zip(["2026-01-05", "2026-01-06", "2026-01-07"], QUESTIONS):
        diags += observe(
            diag, tok, tok.encode(chat(("user", q), system=f"Today is {date}.\n{SYSTEM}")), [[5]] * 2
        )
    report = build_report(
        [],
        None,
        RateCard.from_tomls([("t", "[models.default]\nprefill=1\nsample=3\ntrain=3\n")]),
        diagnostics=diags,
    )
    (p,) = report.diagnostics
    assert p.pattern == "varying_head" and p.requests == 2
    assert p.tokens_lost == sum(d.tokens_lost for d in diags)
    assert p.cost_lost == pytest.approx(p.tokens_lost * 0.8 / 1e6, rel=1e-12, abs=0)  # a few fp64 roundings
    assert "fixed content" in p.fix
