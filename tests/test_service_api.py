"""The service as a second front end sees it: protocol-neutral results, streaming, cancellation."""
from __future__ import annotations

import asyncio

import pytest

from serverutil import serve
from trine.engine.interface import SampleCancelled, SampleDelta
from trine.engine.lora import LoRAConfig
from trine.engine.ops import Forward, InitRun
from trine.engine.requests import SamplingOptions, TrainDatum
from trine.limits import FORWARD_BACKWARD, INIT_RUN
from trine.service import SampleOutcome, SampleSpec


def test_neutral_outcomes_stream_retry_and_cancel(tiny_model_dir, tmp_path):
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        svc = srv.service

        def call(coro):
            return asyncio.run_coroutine_threadsafe(coro, svc.loop).result(60)

        key = svc.authenticate(srv.api_key)
        session = svc.create_session(key, "test")
        run = svc.create_sampling_run(key, session.id, base_model="tiny-llama")
        opts = SamplingOptions(max_tokens=6, temperature=1.0, seed=3)
        spec = SampleSpec("r1", [5, 6, 7, 8, 9], opts, num_samples=2)

        first = call(svc.sample(key, run.id, spec))
        assert isinstance(first, SampleOutcome) and len(first.sequences) == 2
        u = first.usage
        assert u["prompt_tokens"] == 5 == u["prefill_tokens"] + u["cached_tokens"]
        assert call(svc.sample(key, run.id, spec)) == first  # a retry: the stored outcome

        async def stream(spec):
            return [x async for x in svc.sample_stream(key, run.id, spec)]
        items = call(stream(SampleSpec("r2", [5, 6, 7, 8, 9], opts, num_samples=2)))
        final = items[-1]
        assert isinstance(final, SampleOutcome) and all(isinstance(d, SampleDelta) for d in items[:-1])
        assert [s.tokens for s in final.sequences] == [s.tokens for s in first.sequences]  # same seed

        async def cancelled():
            long = SampleSpec("r3", [5, 6], SamplingOptions(max_tokens=1000, stop_at_eos=False))
            task = asyncio.ensure_future(svc.sample(key, run.id, long))
            await asyncio.sleep(0.3)
            assert await svc.cancel_sample(key, run.id, "r3")
            with pytest.raises(SampleCancelled):
                await task
        call(cancelled())
        metered = [e.request_id for e in svc.usage_events(key, run_id=run.id)]
        assert metered == ["r1", "r2"]  # once each; the cancelled request is not metered

        # training events: the stored result is neutral (lists of floats), shaped by front ends
        trun = svc.create_training_run(key, session.id, base_model="tiny-llama", lora_rank=4)
        tokens = list(range(100, 120))
        call(svc.submit_event(key, trun.id, event_id="e1", type=INIT_RUN, index=1, step=0,
                              op=InitRun(LoRAConfig(rank=4))))
        call(svc.submit_event(key, trun.id, event_id="e2", type=FORWARD_BACKWARD, index=2, step=0,
                              op=Forward([TrainDatum(tokens, tokens[1:] + [-100], [1.0] * 20)],
                                         "cross_entropy")))
        rec = call(svc.event(key, trun.id, "e2", wait=30))
        res = svc.event_result(rec)
        assert res.status == "succeeded" and res.train_tokens == 20 and res.cycle is not None
        assert len(res.logprobs[0]) == 20 and all(isinstance(x, float) for x in res.losses[0])
        assert res.metrics["token_count"] == 19
