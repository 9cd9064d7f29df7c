"""How far the served engine paths round: the measurement behind tolerance.SERVED_ROUNDING.

    .venv/bin/python tests/served_rounding.py                 # this CPU's kernels
    ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE .venv/bin/python tests/served_rounding.py

On each tiny model (llama, qwen2, qwen3) with a rank-4 adapter whose B is not zero, the Sampler
(paged attention, packed GEMMs: sampled tokens' logprobs and prompt logprobs) and the Trainer's
forward score the same tokens on the fp32 model and on its fp64 twin; it prints each path's largest
distance from fp64, absolute and relative to the logprobs' scale, the two fp32 paths' distance from
each other, and a cross-entropy step's loss and grad norm against fp64. Not a test: run it when the
engine's kernels change, and update SERVED_ROUNDING if the worst relative error moves.
"""

import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import build_tiny_model_dir  # noqa: E402
from tolerance import fp64_model  # noqa: E402

from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, SampleRequest, SamplingOptions, TrainDatum  # noqa: E402
from trine.engine.config import SamplerConfig, TrainerConfig  # noqa: E402
from trine.engine.model.tokenizer import Tokenizer  # noqa: E402
from trine.engine.model.weights import load_model  # noqa: E402
from trine.engine.sampler.sampler import Sampler  # noqa: E402
from trine.engine.trainer.trainer import Trainer  # noqa: E402

_ids = iter(range(10**9))


def setup(model, tok, src=None):
    tr = Trainer(model, base_model="tiny", config=TrainerConfig(micro_batch_tokens=1024))
    tr.create_run("r", LoRAConfig(rank=4))
    with torch.no_grad():
        if src is None:
            for b in tr.adapter("r").B.values():
                b.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        else:
            for (_n, p), (_m, q) in zip(
                src.adapter("r").named_parameters(), tr.adapter("r").named_parameters()
            ):
                q.copy_(p)
    return tr


def run(model, tok, tr, ps):
    s = Sampler(model, tok, SamplerConfig(kv_cache_bytes=64 << 20, max_batch_tokens=512))
    opts = SamplingOptions(max_tokens=6, temperature=1.0, seed=11, stop_at_eos=False)
    reqs = [
        (
            SampleRequest(
                f"n{next(_ids)}", list(p), opts, tr.weights_identity("r"), num_samples=2, prompt_logprobs=True
            ),
            tr.snapshot("r"),
        )
        for p in ps
    ]
    out = s.run(reqs)
    toks = [[sq.tokens for sq in r.sequences] for r in out]
    sampled = [sq.logprobs for r in out for sq in r.sequences]
    prompt_lp = [r.prompt_logprobs[1:] for r in out]
    data = [
        TrainDatum(tokens=p + t[:-1], target_tokens=[-100] * (len(p) - 1) + t)
        for p, ts in zip(ps, toks)
        for t in ts
    ]
    fwd = tr.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))], backward=False)[0]
    trained = [lp[-len(w) :] for lp, w in zip(fwd.logprobs, sampled)]
    pdata = [TrainDatum(tokens=p[:-1], target_tokens=p[1:]) for p in ps]
    pf = tr.forward_backward([("r", Forward(pdata, Loss.parse("cross_entropy")))], backward=True)[0]
    m = tr.optim_step("r", AdamConfig(learning_rate=1e-2))
    return (
        dict(sampled=sampled, trained=trained, prompt_s=prompt_lp, prompt_t=pf.logprobs),
        toks,
        pf.loss_sum,
        m["grad_norm"],
    )


def flat(x):
    return torch.tensor([v for row in x for v in row], dtype=torch.float64)


def main() -> None:
    torch.set_num_threads(1)
    print("kernels:", torch.backends.cpu.get_cpu_capability())
    rng = random.Random(3)
    ps = [[1] + [rng.randrange(100, 40000) for _ in range(n)] for n in (12, 39, 70)]
    worst = {}
    for fam in ("llama", "qwen2", "qwen3"):
        d = Path(tempfile.gettempdir()) / f"trine-served-rounding-{fam}"
        if not d.exists():
            build_tiny_model_dir(fam, d)
        tok = Tokenizer(d)
        m32 = load_model(d, "cpu")
        m64 = fp64_model(d)
        t32 = setup(m32, tok)
        t64 = setup(m64, tok, t32)
        r32, k32, l32, g32 = run(m32, tok, t32, ps)
        r64, k64, l64, g64 = run(m64, tok, t64, ps)
        assert k32 == k64, "tokens differ"
        scale = max(float(flat(v).abs().max()) for v in r64.values())
        line = [fam, f"scale {scale:.2f}"]
        for k in r32:
            e = float((flat(r32[k]) - flat(r64[k])).abs().max())
            line.append(f"{k} abs {e:.2e} rel {e / scale:.2e}")
            worst[k] = max(worst.get(k, 0), e / scale)
        d_st = float((flat(r32["sampled"]) - flat(r32["trained"])).abs().max())
        d_pp = float((flat(r32["prompt_s"]) - flat(r32["prompt_t"])).abs().max())
        line.append(
            f"| fp32 sampler-trainer: sampled {d_st:.2e} prompt {d_pp:.2e}"
            f" (rel {max(d_st, d_pp) / scale:.2e})"
        )
        line.append(
            f"| loss_sum rel {abs(l32 - l64) / abs(l64):.2e} grad_norm rel {abs(g32 - g64) / g64:.2e}"
        )
        worst["pair"] = max(worst.get("pair", 0), max(d_st, d_pp) / scale)
        worst["loss"] = max(worst.get("loss", 0), abs(l32 - l64) / abs(l64))
        worst["gnorm"] = max(worst.get("gnorm", 0), abs(g32 - g64) / g64)
        print("\n  ".join(line), flush=True)
    print("worst", {k: f"{v:.2e}" for k, v in worst.items()})


if __name__ == "__main__":
    main()
