"""The service as a second front end sees it: protocol-neutral results, streaming, cancellation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from serverutil import serve

from trine.engine.api import (
    Forward,
    LoRAConfig,
    Loss,
    SampleCancelled,
    SampleDelta,
    SampleRequest,
    SamplingOptions,
    TrainDatum,
)
from trine.service import EventResult, InitByUri, SampleOutcome, SamplingRunSpec, TrainingRunSpec


def test_neutral_outcomes_stream_retry_and_cancel(tiny_model_dir, tmp_path):
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        svc = srv.service

        def call(coro):
            return asyncio.run_coroutine_threadsafe(coro, svc.loop).result(60)

        key = svc.ownership.authenticate(srv.api_key)
        session = svc.runs.create_session(key, "test")
        run = svc.runs.create_sampling_run(key, session.id, SamplingRunSpec("tiny-llama"))
        spec = SampleRequest(
            "r1", [5, 6, 7, 8, 9], SamplingOptions(max_tokens=6, temperature=1.0, seed=3), num_samples=2
        )

        first = call(svc.sampling.sample(key, run.id, spec))
        assert isinstance(first, SampleOutcome) and len(first.sequences) == 2
        u = first.usage
        assert u["prompt_tokens"] == 5 == u["prefill_tokens"] + u["cached_tokens"]
        assert call(svc.sampling.sample(key, run.id, spec)) == first  # a retry: the stored outcome

        async def stream(spec):
            return [x async for x in svc.sampling.sample_stream(key, run.id, spec)]

        items = call(stream(dataclasses.replace(spec, request_id="r2")))
        final = items[-1]
        assert isinstance(final, SampleOutcome) and all(isinstance(d, SampleDelta) for d in items[:-1])
        assert {d.request_id for d in items[:-1]} == {"r2"}  # chunks name the request as the client did
        assert [s.tokens for s in final.sequences] == [s.tokens for s in first.sequences]  # same seed
        for i, s in enumerate(final.sequences):  # the chunks of a sequence add up to it
            assert [t for d in items[:-1] if d.sequence == i for t in d.tokens] == s.tokens

        async def cancelled():
            long = SampleRequest("r3", [5, 6], SamplingOptions(max_tokens=1000, stop_at_eos=False))
            task = asyncio.ensure_future(svc.sampling.sample(key, run.id, long))
            await asyncio.sleep(0.3)
            assert await svc.sampling.cancel(key, run.id, "r3")
            with pytest.raises(SampleCancelled):
                await task

        call(cancelled())
        events = svc.usage_events(key, run_id=run.id)
        assert [e.request_id for e in events] == ["r1", "r2", "r3"]  # once each
        assert events[-1].prefill + events[-1].prefill_cached == 2  # the cancelled one: its prompt,
        assert 0 < events[-1].sample < 1000  # and the tokens it sampled before the cancel

        # training events: the stored result is neutral (lists of floats), shaped by front ends
        trun = svc.runs.create_training_run(
            key, session.id, TrainingRunSpec("tiny-llama", LoRAConfig(rank=4))
        )
        tokens = list(range(100, 120))
        init = InitByUri(lora=LoRAConfig(rank=4))
        call(svc.events.submit(key, trun.id, event_id="e1", index=1, step=0, command=init))
        forward = Forward([TrainDatum(tokens, tokens[1:] + [-100], [1.0] * 20)], Loss.parse("cross_entropy"))
        call(svc.events.submit(key, trun.id, event_id="e2", index=2, step=0, command=forward))
        rec = call(svc.events.event(key, trun.id, "e2", wait=30))
        assert rec.type == "trainer.forward_backward"  # the event type follows the command
        res = EventResult.of(rec)
        assert res.status == "succeeded" and res.train_tokens == 20 and res.cycle is not None
        assert len(res.logprobs[0]) == 20 and all(isinstance(x, float) for x in res.losses[0])
        assert res.metrics["token_count"] == 19
