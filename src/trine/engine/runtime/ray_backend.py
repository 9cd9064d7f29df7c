"""The Ray backend of the engine interface: each replica is a Ray actor holding a `LocalEngine`.

`trine serve --ray [ADDRESS] --replicas N` builds N `RayEngine`s per base model with
`ray_engines(...)`. Importing this module imports Ray; nothing else in trine does, so a server
without `--ray` never loads it.

Each actor is an asyncio actor: its calls run on the actor's event loop and reach the engine thread
inside it exactly as in-process calls do, so sampling still interleaves with training cycles. An
actor takes one GPU when the cluster has GPUs, otherwise its config's `num_threads` CPUs (torch uses as many
threads). Calls and results are the interface's dataclasses, pickled by Ray.

Each replica process starts its own session (`os.setsid`, Linux and macOS). Ray starts every worker in
the session of whoever started the raylet (for a local cluster: trine's own shell session), and with
the kernel's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`, on by default in most
distributions) CFS shares the CPU fairly between sessions first, then between the threads inside one.
So on a machine where any other session is busy, N replicas in one session got one session's share
between them: on 2 shared cores one replica used 0.81 core and two replicas used 0.81 core together
(benchmarks/pool.py, issue 32). In their own sessions each replica competes as a server of its own
would. Where no other session wants the CPU, nothing changes.

Invariants
- A dead actor (killed, out of memory, its node gone) turns every call in flight, and every later
  call, into `EngineLost` (Ray fails the pending object refs as soon as it learns of the death;
  `lost()` returns then).
- Errors the engine raises reach the caller as the engine raised them (Ray's wrapper is removed), so
  a ValueError is still a ValueError with the engine's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import AsyncIterator

import ray
from ray.exceptions import RayError, RayTaskError

from ..api import (
    CycleResult,
    EngineInfo,
    EngineLost,
    EngineStats,
    LoRAConfig,
    SampleDelta,
    SampleRequest,
    SampleResult,
    TrainingCycle,
)
from ..config import EngineConfig
from ..interface import Engine
from ..malloc import keep_freed_memory
from ..setup import configure, openmp_wait
from .ray_cluster import watch_local_cluster


def _lost(index: int, name: str, e: RayError) -> EngineLost:
    """Any Ray failure that is not the engine's own exception (actor died, killed for memory, node
    lost, ...) means the replica is gone."""
    return EngineLost(f"replica {index} of {name}: {type(e).__name__}")


def _cause(e: RayTaskError) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


def own_session() -> bool:
    """Make this process the leader of a new session (so of its own scheduler autogroup); False
    where the platform has no sessions or the kernel refuses.

    The raylet makes each worker a process-group leader (so it can end the worker's children with
    it), and a group leader may not start a session: the worker first joins its parent's group,
    then starts the session, which makes it a group leader again with the same id (its pid), so the
    raylet's group kill still reaches it and its children."""
    if not hasattr(os, "setsid"):
        return False
    leader = os.getpgrp() == os.getpid()
    try:
        if leader:
            os.setpgid(0, os.getpgid(os.getppid()))
        os.setsid()
    except OSError:  # EPERM: the parent's group is in another session, or similar
        if leader and os.getpgrp() != os.getpid():
            os.setpgid(0, 0)  # lead a group again, as the raylet expects
        return False
    return True


def process_info() -> dict:
    """This process as the scheduler sees it: pid, session, CPU-seconds so far (user + system),
    torch's intra-op threads, how its OpenMP threads wait (`trine.engine.setup.openmp_wait`) and what its
    C allocator keeps (`trine.engine.malloc`)."""
    import torch  # loaded by the engine already

    t = os.times()
    return dict(
        pid=os.getpid(),
        sid=os.getsid(0),
        cpu_s=t.user + t.system,
        torch_threads=torch.get_num_threads(),
        openmp_wait=openmp_wait(),
        malloc=keep_freed_memory(),
    )


@ray.remote
class ReplicaActor:
    """One engine replica in its own process (and, where it can, its own session)."""

    def __init__(
        self, name: str, model_dir: str, replica: str, config: EngineConfig, new_session: bool = True
    ):
        if new_session:
            own_session()
        configure()  # before torch loads in this process: this module and Ray's worker import none
        from .local import LocalEngine

        self.engine = LocalEngine(name, model_dir, config, replica=replica)

    async def process(self) -> dict:
        return process_info()

    async def start(self) -> EngineInfo:
        return await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def sample(self, req: SampleRequest) -> SampleResult:
        return await self.engine.sample(req)

    async def sample_stream(self, req: SampleRequest):
        async for item in self.engine.sample_stream(req):
            yield item

    async def cancel(self, request_id: str):
        return await self.engine.cancel(request_id)

    async def run_cycle(self, cycle: TrainingCycle) -> CycleResult:
        return await self.engine.run_cycle(cycle)

    async def drop_run(self, run_id: str) -> None:
        await self.engine.drop_run(run_id)

    async def load_adapter(self, checkpoint_id: str, path: str) -> int:
        return await self.engine.load_adapter(checkpoint_id, path)

    async def evict_adapter(self, checkpoint_id: str) -> None:
        await self.engine.evict_adapter(checkpoint_id)

    async def spill_adapter(self, checkpoint_id: str, lora: LoRAConfig, path: str) -> int:
        return await self.engine.spill_adapter(checkpoint_id, lora, path)

    async def publish_target(self, target: str, version: int, checkpoint_id: str) -> None:
        await self.engine.publish_target(target, version, checkpoint_id)

    async def stats(self) -> EngineStats:
        return await self.engine.stats()

    async def lost(self) -> str:
        return await self.engine.lost()


class RayEngine(Engine):
    """The service-side handle of one replica actor."""

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        index: int,
        config: EngineConfig = EngineConfig(),
        *,
        num_gpus: float = 0,
        new_session: bool = True,
    ):
        self.name = name
        self.index = index
        # an actor reserves its threads' CPUs, so it needs a count; on a GPU node it runs there
        config = dataclasses.replace(
            config,
            num_threads=config.num_threads or 1,
            device=config.device or ("cuda" if num_gpus else None),
        )
        self.actor = ReplicaActor.options(
            num_cpus=0 if num_gpus else config.num_threads,
            num_gpus=num_gpus,
            max_concurrency=1000,
            max_restarts=0,
            max_task_retries=0,
        ).remote(name, str(model_dir), f"ray:{name}/{index}", config, new_session)

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayTaskError as e:  # the engine's own exception, as the engine raised it
            raise _cause(e) from None
        except RayError as e:
            raise _lost(self.index, self.name, e) from None

    async def start(self) -> EngineInfo:
        self.info = await self._call("start")
        return self.info

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(self._call("stop"), 30)
        except (EngineLost, asyncio.TimeoutError):
            pass
        ray.kill(self.actor, no_restart=True)

    async def sample(self, req: SampleRequest) -> SampleResult:
        return await self._call("sample", req)

    async def sample_stream(self, req: SampleRequest) -> AsyncIterator[SampleDelta | SampleResult]:
        done = False
        try:
            async for ref in self.actor.sample_stream.remote(req):
                item = await ref
                done = isinstance(item, SampleResult)
                yield item
        except RayTaskError as e:
            raise _cause(e) from None
        except RayError as e:
            raise _lost(self.index, self.name, e) from None
        finally:
            if not done:
                try:
                    await self.cancel(req.request_id)
                except EngineLost:
                    pass

    async def cancel(self, request_id: str):
        """Whatever the engine's cancel answers (its partial result, where it reports one)."""
        return await self._call("cancel", request_id)

    async def run_cycle(self, cycle: TrainingCycle) -> CycleResult:
        return await self._call("run_cycle", cycle)

    async def drop_run(self, run_id: str) -> None:
        await self._call("drop_run", run_id)

    async def load_adapter(self, checkpoint_id: str, path: str) -> int:
        return await self._call("load_adapter", checkpoint_id, path)

    async def evict_adapter(self, checkpoint_id: str) -> None:
        await self._call("evict_adapter", checkpoint_id)

    async def spill_adapter(self, checkpoint_id: str, lora: LoRAConfig, path: str) -> int:
        return await self._call("spill_adapter", checkpoint_id, lora, path)

    async def publish_target(self, target: str, version: int, checkpoint_id: str) -> None:
        await self._call("publish_target", target, version, checkpoint_id)

    async def stats(self) -> EngineStats:
        return await self._call("stats")

    async def process(self) -> dict:
        """The replica's process: pid, session, CPU-seconds used so far, threads (`process_info`)."""
        return await self._call("process")

    async def lost(self) -> str:
        try:
            return await self._call("lost")
        except EngineLost as e:
            return str(e)


def connect(address: str | None, *, num_cpus: int | None = None) -> dict:
    """Join the Ray cluster at `address` ("auto": the one `ray start` made on this machine), or
    start a local one when `address` is None, which stops when this process ends, even killed
    (ray_cluster.py). Returns the cluster's resources."""
    if not ray.is_initialized():
        kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=num_cpus, **kw)
            watch_local_cluster()
    return ray.cluster_resources()


def ray_engines(replicas: int, config: EngineConfig = EngineConfig(), *, new_session: bool = True):
    """An engine factory for `Service(engines=...)`: `replicas` actors per base model, each running
    `config` (on `config.num_threads` CPUs, 1 if unset), one GPU each when the cluster has GPUs
    (on CUDA unless `config.device` says otherwise). `new_session=False` leaves each replica in the
    raylet's session (the behaviour before issue 32; benchmarks/pool.py --shared-session measures it)."""
    if replicas < 1:
        raise ValueError("replicas: use 1 or more")
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0

    def engines(name: str, model_dir: Path) -> list[Engine]:
        return [
            RayEngine(
                name,
                model_dir,
                i,
                config,
                num_gpus=gpus,
                new_session=new_session,
            )
            for i in range(replicas)
        ]

    return engines
