"""Shared by the console tests: a server with two keys, and a short SFT through the trine SDK whose
results (losses, gradient norms, cycles, tokens) the console must show exactly."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import trine as trio
from serverutil import serve

MODEL = "tiny-llama"
SEQS = [[1, 17, 204, 391, 9, 77, 412, 5], [1, 33, 56, 90, 1203, 4, 88]]


@dataclass
class SftRun:
    run_id: str
    losses: list[float] = field(default_factory=list)  # metrics["loss_mean"] of each forward_backward
    grad_norms: list[float] = field(default_factory=list)
    cycles: list[tuple[int, int]] = field(default_factory=list)  # (forward_backward, optim_step) per step
    train_tokens: list[int] = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)
    checkpoint_uri: str = ""


def sft(url: str, api_key: str, steps: int = 4, save: str | None = "ck-console") -> SftRun:
    """`steps` pipelined SFT steps (forward_backward + optim_step sent before waiting), then a save."""
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
            for s in SEQS]
    with trio.ServiceClient(api_key=api_key, base_url=url) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
        run = SftRun(trainer.training_run_id)
        for _ in range(steps):
            fb = trainer.forward_backward(data, "cross_entropy")
            opt = trainer.optim_step(trio.AdamParams(learning_rate=2e-2))
            out, step = fb.result(), opt.result()
            run.losses.append(out.metrics["loss_mean"])
            run.grad_norms.append(step.metrics["grad_norm"])
            run.cycles.append((out.cycle, step.cycle))
            run.train_tokens.append(out.usage.train_tokens)
            run.loss_tokens.append(out.usage.loss_tokens)
        if save:
            run.checkpoint_uri = trainer.save_state(save).result().path
    return run


@contextlib.contextmanager
def console_server(model_dir, home):
    """A server (its embedded key is alice's) plus a second key, bob's: yields (srv, bob_key)."""
    old = os.environ.get("TRINE_HOME")
    os.environ["TRINE_HOME"] = str(home)
    try:
        with serve(model_dir, home) as srv:
            _, bob = srv.service.store.create_key("bob")
            yield srv, bob
    finally:
        if old is None:
            os.environ.pop("TRINE_HOME", None)
        else:
            os.environ["TRINE_HOME"] = old
