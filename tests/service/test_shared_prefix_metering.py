"""A GRPO group's shared prompt is trained once and metered as computed: `train_tokens` (priced)
beside `train_sequence_tokens` (as sent), through the SDK, the stored usage and the report; with
`TrainerConfig(prefix_sharing=False)` every datum is computed whole and the two counts are equal."""

from __future__ import annotations

import dataclasses

import pytest
from serverutil import TEST_ENGINE, serve

import trine as trio

MODEL = "tiny-llama"
PROMPT = list(range(100, 148))  # 48 tokens: past the shortest prefix worth sharing
COMPLETIONS = [list(range(300 + 10 * i, 308 + 10 * i)) for i in range(4)]  # 8 tokens each


def group() -> list[trio.Datum]:
    out = []
    for c in COMPLETIONS:
        ids = PROMPT + c
        targets = [-100] * (len(PROMPT) - 1) + ids[len(PROMPT) :]
        out.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": targets}
            )
        )
    return out


@pytest.mark.parametrize("sharing", [True, False])
def test_a_group_is_metered_as_computed_and_as_sent(tiny_model_dir, tmp_path, sharing):
    sent = 4 * (len(PROMPT) + 8 - 1)  # each datum: prompt + completion, minus the last token
    computed = len(PROMPT) + 4 * 7 if sharing else sent  # the prompt once, then each completion
    engine = dataclasses.replace(
        TEST_ENGINE, trainer=dataclasses.replace(TEST_ENGINE.trainer, prefix_sharing=sharing)
    )
    with serve(tiny_model_dir, tmp_path / "home", engine=engine) as srv:
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc:
            trainer = svc.create_lora_training_client(MODEL, rank=4)
            out = trainer.forward_backward(group(), "cross_entropy").result()
            assert (out.usage.train_tokens, out.usage.train_sequence_tokens) == (computed, sent)
            assert out.usage.loss_tokens == 4 * 8
        events = [e for e in srv.service.store.usage_events(srv.service.store.keys()[0].id) if e.train]
        assert [(e.train, e.train_sequence) for e in events] == [(computed, sent)]
