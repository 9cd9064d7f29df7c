"""The engine pool on Ray: 2 replicas of a tiny model in a local Ray instance (num_cpus=2).

One Ray instance and one Ray-backed server for the module. The last test kills a replica of that
server, so it stays last in this file.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from serverutil import TEST_ENGINE, pytrio_env, serve, start

import trine as trio
from trine.engine.api import SampleRequest, SamplingOptions
from trine.engine.malloc import keep_freed_memory
from trine.engine.setup import DEFAULT_WAIT, WAIT_SETTINGS, openmp_wait
from trine.service import SamplingRunSpec
from trine.service.routing import Router

ray = pytest.importorskip("ray")
from trine.engine.api import EngineLost  # noqa: E402  (after the skip when ray is missing)
from trine.engine.runtime.ray_backend import RayEngine, connect, ray_engines  # noqa: E402

_OWN_SESSION = """
import os
from trine.engine.runtime.ray_backend import own_session
print(os.getpgrp() == os.getpid(), own_session(), os.getsid(0) == os.getpid() == os.getpgrp())
"""

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def ray_server(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        # Plain sgemm on both sides of the parity test (the replicas inherit this at ray.init, the
        # in-process engine reads it): MKL's packed copies share one budget per process
        # (engine/model/kernels/packed.py), which other tests' models in this long-lived pytest process may
        # have used up, and then only the in-process side's LM head changes kernel (last bits).
        env.setenv("TRINE_PACKED_GEMM_BYTES", "0")
        # and one fixed thread count on both sides (runtime/cpu_share.py would give the in-process
        # engine fewer threads while the replicas' processes are busy)
        env.setenv("TRINE_CPU_SHARE", "0")
        connect(None, num_cpus=2)
        srv = start(
            tiny_model_dir,
            tmp_path_factory.mktemp("ray-home"),
            engines=ray_engines(2, TEST_ENGINE),
        )
        try:
            yield srv
        finally:
            srv.stop()
            ray.shutdown()


class _FailingActor:
    """Stands in for an actor handle whose every call raises `exc`."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __getattr__(self, method):
        exc = self.exc

        class Method:
            def remote(self, *args):
                async def call():
                    raise exc

                return call()

        return Method()


def test_any_ray_failure_is_a_lost_replica_but_engine_errors_keep_their_type():
    engine = RayEngine.__new__(RayEngine)  # no actor: the handle is replaced below
    engine.name, engine.index = MODEL, 0
    for exc in (ray.exceptions.OutOfMemoryError("killed for memory"), ray.exceptions.ActorDiedError()):
        engine.actor = _FailingActor(exc)
        with pytest.raises(EngineLost, match="replica 0"):
            asyncio.run(engine.stats())
        assert "replica 0" in asyncio.run(engine.lost())
    own = ray.exceptions.RayTaskError(
        "sample", "traceback", ValueError("prompt: too long")
    ).as_instanceof_cause()
    engine.actor = _FailingActor(own)
    with pytest.raises(ValueError, match="too long"):
        asyncio.run(engine.stats())


@pytest.mark.skipif(not hasattr(os, "setsid"), reason="no POSIX sessions")
def test_own_session_lets_a_process_group_leader_start_a_session_that_keeps_its_group_id():
    """As the raylet starts a worker: leader of its own process group, in its parent's session."""
    out = subprocess.run(
        [sys.executable, "-c", _OWN_SESSION], process_group=0, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "True", "True"], out.stderr


def test_each_replica_runs_in_its_own_session_with_one_torch_thread(ray_server):
    """So the kernel's autogroup scheduler gives each replica a share of its own (issue 32)."""
    replicas = ray_server.service.models[MODEL].replicas
    procs = [ray.get(rep.engine.actor.process.remote()) for rep in replicas]
    sessions = {p["sid"] for p in procs}
    assert len(sessions) == len(replicas) == 2
    assert os.getsid(0) not in sessions
    assert all(p["sid"] == p["pid"] and p["torch_threads"] == 1 for p in procs)
    # trine.engine, imported in the replica before its torch, sets the short spin unless this
    # process's environment (which the raylet passes on) already named a policy
    named = os.environ.keys() & set(WAIT_SETTINGS)
    default = " ".join(f"{k}={v}" for k, v in DEFAULT_WAIT.items())
    assert all(p["openmp_wait"] == (openmp_wait() if named else default) for p in procs)
    # and keeps its freed per-step tensors in the heap (engine/malloc.py), as this process does
    assert all(p["malloc"] == keep_freed_memory() for p in procs)


def _sft_batch(tokenizer_ids: list[list[int]]) -> list[trio.Datum]:
    return [
        trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        for ids in tokenizer_ids
    ]


def _train_and_sample(srv) -> dict:
    batch = _sft_batch([list(range(300, 340)), list(range(1000, 1025))])
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc:
        tc = svc.create_lora_training_client(MODEL, rank=4, seed=11)
        losses, lps = [], []
        for _ in range(3):
            fb = tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
            out = fb.result()
            losses.append(out.metrics["loss_sum"])
            lps.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
        uri = tc.save_weights_for_sampler("parity").result().path
        sampler = tc.save_weights_and_get_sampling_client()
        res = sampler.sample(
            trio.ModelInput.from_ints(list(range(50, 70))),
            num_samples=3,
            sampling_params=trio.SamplingParams(max_tokens=8, temperature=1.0, seed=5),
        ).result()
    path = srv.service.store.checkpoint_by_uri(uri).path
    return {
        "losses": losses,
        "logprobs": lps,
        "weights": load_file(f"{path}/adapter_model.safetensors"),
        "tokens": [s.tokens for s in res.sequences],
        "sample_logprobs": [s.logprobs for s in res.sequences],
    }


def test_ray_replica_gives_the_same_samples_losses_and_weights_as_in_process(
    ray_server, tiny_model_dir, tmp_path
):
    on_ray = _train_and_sample(ray_server)
    with serve(tiny_model_dir, tmp_path / "home") as local:
        in_proc = _train_and_sample(local)
    # bit for bit (kind 1): the same engine code on the same data in the same order, in a Ray actor
    assert on_ray["losses"] == in_proc["losses"]
    assert on_ray["logprobs"] == in_proc["logprobs"]
    assert on_ray["tokens"] == in_proc["tokens"]
    assert on_ray["sample_logprobs"] == in_proc["sample_logprobs"]
    assert on_ray["weights"].keys() == in_proc["weights"].keys()
    for k, v in on_ray["weights"].items():
        assert torch.equal(v, in_proc["weights"][k]), k


def _cached_fraction(srv, router: Router, seed: int) -> tuple[float, set[int]]:
    """4-turn conversations and groups of 8 (sent at once): cached / prompt tokens of every request
    that could hit (turns 2-4, group members 2-8)."""
    svc = srv.service
    svc.sampling.router = router
    key = svc.authenticate(srv.api_key)
    run = svc.runs.create_sampling_run(key, svc.runs.create_session(key, "t").id, SamplingRunSpec(MODEL))
    g = torch.Generator().manual_seed(seed)
    n = [0]

    def spec(prompt):
        n[0] += 1
        return SampleRequest(
            f"q{seed}-{n[0]}", prompt, SamplingOptions(max_tokens=4, temperature=1.0, seed=1)
        )

    async def workload():
        cached = prompt_tokens = 0
        replicas = set()
        for _conv in range(3):
            prompt = torch.randint(100, 40000, (200,), generator=g).tolist()
            for turn in range(4):
                out = await svc.sampling.sample(key, run.id, spec(prompt))
                replicas.add(out.replica)
                if turn:
                    cached += out.usage["cached_tokens"]
                    prompt_tokens += out.usage["prompt_tokens"]
                prompt = (
                    prompt + out.sequences[0].tokens + torch.randint(100, 40000, (12,), generator=g).tolist()
                )
        for _group in range(2):
            prompt = torch.randint(100, 40000, (200,), generator=g).tolist()
            first = await svc.sampling.sample(key, run.id, spec(prompt))
            replicas.add(first.replica)
            rest = await asyncio.gather(*(svc.sampling.sample(key, run.id, spec(prompt)) for _ in range(7)))
            cached += sum(o.usage["cached_tokens"] for o in rest)
            prompt_tokens += sum(o.usage["prompt_tokens"] for o in rest)
        return cached / prompt_tokens, replicas

    return asyncio.run_coroutine_threadsafe(workload(), svc.loop).result(300)


def test_prefix_routing_keeps_conversations_and_groups_cached_and_random_does_not(ray_server):
    routed, used = _cached_fraction(ray_server, Router(), seed=1)
    randomly, _ = _cached_fraction(ray_server, Router("random", seed=0), seed=2)
    ray_server.service.sampling.router = Router()
    assert routed >= 0.9, routed
    assert used == {0, 1}  # different conversations went to different replicas
    assert randomly < routed - 0.15, (randomly, routed)


def test_official_pytrio_client_against_a_ray_backed_server(ray_server):
    with pytrio_env(ray_server.url, ray_server.api_key) as pytrio:
        client = pytrio.ServiceClient()
        try:
            tc = client.create_lora_training_client(base_model=MODEL, rank=4, seed=2)
            data = [
                pytrio.Datum(
                    model_input=pytrio.ModelInput.from_ints(list(range(20, 40))),
                    loss_fn_inputs={"target_tokens": list(range(21, 41))},
                )
            ]
            first = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(pytrio.AdamParams(learning_rate=1e-2)).result()
            second = tc.forward_backward(data, "cross_entropy").result()
            assert second.metrics["loss_sum"] < first.result().metrics["loss_sum"]
            sampler = tc.save_weights_and_get_sampling_client()
            out = sampler.sample(
                pytrio.ModelInput.from_ints([5, 6, 7]),
                num_samples=2,
                sampling_params=pytrio.SamplingParams(max_tokens=4),
            ).result()
            assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
        finally:
            client._runtime.shutdown()


def test_an_inflight_save_reaches_the_replica_serving_the_target_beside_the_trainer(ray_server):
    svc = ray_server.service
    m = svc.models[MODEL]
    with trio.ServiceClient(api_key=ray_server.api_key, base_url=ray_server.url) as client:
        trainer = client.create_lora_training_client(MODEL, rank=4, seed=4)
        inflight = trainer.inflight_sampling_client()
        key = svc.authenticate(ray_server.api_key)
        run_id = svc.ownership.sampling_run(key, inflight.sampling_run_id).inflight_run_id
        training_replica = m.placement[run_id].index
        prompt = list(range(300, 340))

        def sample(tag: str):
            async def go():
                return [
                    await svc.sampling.sample(
                        key,
                        inflight.sampling_run_id,
                        SampleRequest(f"{tag}-{i}", prompt, SamplingOptions(max_tokens=5, temperature=0.0)),
                    )
                    for i in range(3)
                ]

            return asyncio.run_coroutine_threadsafe(go(), svc.loop).result(120)

        first = sample("a")  # served beside the trainer, which loads version 1 from disk
        assert {o.replica for o in first} == {1 - training_replica}
        assert all(o.sequences[0].weights_versions == [1] * 5 for o in first)
        data = [
            trio.Datum(
                model_input=trio.ModelInput.from_ints(prompt),
                loss_fn_inputs={"target_tokens": list(range(301, 341))},
            )
        ]
        for _ in range(4):
            trainer.forward_backward(data)
            trainer.optim_step(trio.AdamParams(learning_rate=5e-2))
        trainer.inflight_sampling_client()  # version 2: pushed to the other replica once it settles
        deadline = time.time() + 60
        while any(rep.targets.get(run_id) != 2 for rep in m.replicas) and time.time() < deadline:
            time.sleep(0.1)
        assert [rep.targets.get(run_id) for rep in m.replicas] == [2, 2]
        second = sample("b")
        assert all(o.sequences[0].weights_versions == [2] * 5 for o in second)
        snapshot = trainer.save_weights_and_get_sampling_client()  # served where it was trained
        trained = snapshot.sample(
            trio.ModelInput.from_ints(prompt),
            sampling_params=trio.SamplingParams(max_tokens=5, temperature=0.0),
        )
        assert second[0].sequences[0].tokens == trained.result().sequences[0].tokens
        assert second[0].sequences[0].tokens != first[0].sequences[0].tokens


def test_killed_replica_fails_its_events_at_once_others_go_on_and_the_run_restores(ray_server):
    """Runs last: it kills replica 0 of the module's server."""
    svc_obj = ray_server.service
    batch = _sft_batch([list(range(400, 430))])
    adam = trio.AdamParams(learning_rate=1e-2)
    with trio.ServiceClient(api_key=ray_server.api_key, base_url=ray_server.url) as svc:
        runs = [svc.create_lora_training_client(MODEL, rank=4, seed=i) for i in range(2)]
        for tc in runs:
            tc.forward_backward(batch, "cross_entropy").result()
            tc.optim_step(adam).result()
        placement = svc_obj.models[MODEL].placement
        homes = {tc.training_run_id: placement[tc.training_run_id] for tc in runs}
        assert {rep.index for rep in homes.values()} == {0, 1}  # placed by load
        doomed, survivor = sorted(runs, key=lambda tc: homes[tc.training_run_id].index)
        saved = doomed.save_state("before-kill").result().path

        pending = []
        for _ in range(3):  # pipelined: queued and running when the replica dies
            pending += [doomed.forward_backward(batch, "cross_entropy"), doomed.optim_step(adam)]
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and sum(live.record.run_id == doomed.training_run_id for live in svc_obj.events.live.values()) < 6
        ):
            time.sleep(0.01)  # until the server has accepted all six
        t0 = time.monotonic()
        ray.kill(homes[doomed.training_run_id].engine.actor, no_restart=True)
        codes = []
        for fut in pending:
            with pytest.raises(trio.TrineError) as err:
                fut.result(timeout=60)
            codes.append(err.value.code)
        assert time.monotonic() - t0 < 30
        assert set(codes) == {"worker_lost"}, codes

        out = survivor.forward_backward(batch, "cross_entropy").result()  # the other replica goes on
        survivor.optim_step(adam).result()
        assert out.metrics["token_count"] == 29

        restored = svc.create_training_client_from_state(saved)  # placed on the live replica
        assert restored.forward_backward(batch, "cross_entropy").result().metrics["token_count"] == 29
        assert placement[restored.training_run_id].index == homes[survivor.training_run_id].index

        sampler = svc.create_sampling_client(base_model=MODEL)  # sampling is rerouted
        for i in range(4):
            res = sampler.sample(
                trio.ModelInput.from_ints([7, 8, 9, i]),
                num_samples=1,
                sampling_params=trio.SamplingParams(max_tokens=3),
            ).result()
            seq = res.sequences[0]  # served by the live replica: 3 tokens, or fewer ending at EOS
            assert len(seq.tokens) == 3 or (seq.stop_reason == "stop" and 1 <= len(seq.tokens) < 3), seq

        key = svc_obj.authenticate(ray_server.api_key)
        metered = [e.operation for e in svc_obj.usage_events(key, run_id=doomed.training_run_id)]
        assert metered == ["forward_backward", "optim_step"]  # the failed events cost nothing
        assert svc_obj.store.training_run(doomed.training_run_id).status == "INTERRUPTED"
