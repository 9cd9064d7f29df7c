"""Slow tier: tinker-cookbook 0.6.1 recipes, unmodified, against trine on SmolLM2-135M-Instruct, offline.

Each recipe runs in a child process through the cookbook's own entry point, configured only with
config values; the server runs in this process (tests/serverutil.py) and the child finds it through
TINKER_BASE_URL / TINKER_API_KEY (the key's `tml-` form). `model_name` is the served model's directory,
so the cookbook's `get_tokenizer` loads it locally; HF_HUB_OFFLINE=1, and the data is local: `sl_basic`
trains on the cookbook's bundled `example_data/conversations.jsonl`, `math_rl`'s arithmetic
environment generates its problems. SmolLM2 has no entry in the cookbook's model table, so the
renderer is named explicitly (`role_colon`).

- `math_rl`: `python -m tinker_cookbook.recipes.math_rl.train ...` (its chz CLI), with
  `loss_fn=importance_sampling` and with its default `stable_reinforce`; and with its async config
  (`max_steps_off_policy=1`: sampling and training overlap, data up to one step off-policy).
- `sl_basic`: its CLI (`python -m tinker_cookbook.recipes.sl_basic`) cannot start for any model outside
  the cookbook's table (`build_config_blueprint` asks `model_info.get_recommended_renderer_name` first and
  that raises `ConfigurationError: Unknown model`), and `python -m tinker_cookbook.supervised.train`
  fails in chz ("Nested entrypoints must take a type annotated argument"). So `python
  tests/server/test_tinker_cookbook.py sl_basic KEY=VALUE...` builds `supervised.train.Config` with chz from
  sl_basic's own values (lr 2e-4 linear, 1 epoch, all assistant messages) plus the arguments, swaps in
  the bundled conversations file as the recipe's comment shows, and calls the recipe's `main` unchanged.
Run `python tests/server/test_tinker_cookbook.py` to print the figures docs/benchmarks.md quotes
("tinker-cookbook recipes").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RENDERER = "role_colon"


def cookbook_dir() -> Path:
    import tinker_cookbook

    return Path(tinker_cookbook.__file__).parent


def sl_basic_main(argv: list[str]) -> None:
    """sl_basic's blueprint values for a model outside the cookbook's table, then its own main.

    argv: `KEY=VALUE` overrides of `supervised.train.Config` (model_name and renderer_name required),
    plus `batch_size`, the conversations per step (sl_basic's 128 when absent)."""
    import chz
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    values = dict(a.split("=", 1) for a in argv)
    model, renderer = values["model_name"], values["renderer_name"]
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=renderer,
        max_length=32768,
        batch_size=int(values.pop("batch_size", 128)),
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    dataset = FromConversationFileBuilder(
        common_config=common, file_path=str(cookbook_dir() / "example_data" / "conversations.jsonl")
    )
    blueprint = chz.Blueprint(train.Config).apply(
        {
            "model_name": model,
            "recipe_name": "recipe_sl_basic",
            "renderer_name": renderer,
            "dataset_builder": dataset,
            "learning_rate": 2e-4,
            "lr_schedule": "linear",
            "num_epochs": 1,
            "eval_every": 8,
        }
    )
    blueprint.make_from_argv([f"{k}={v}" for k, v in values.items()])
    sl_basic.main(blueprint.make())


def run_recipe(srv, model_dir: Path, args: list[str]) -> float:
    """Run one recipe command in a child process against `srv`; returns its wall time in seconds."""
    env = dict(
        os.environ,
        TINKER_BASE_URL=srv.url,
        TINKER_API_KEY="tml-" + srv.api_key,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TINKER_TELEMETRY="0",
        NO_PROXY="127.0.0.1,localhost",
        WANDB_MODE="disabled",
    )
    t = time.time()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return time.time() - t


def sl_basic(srv, model_dir: Path, log: Path, steps: int = 6, batch: int = 8) -> tuple[list[float], float]:
    """Train loss (mean NLL per trained token) per step, and the run's seconds."""
    secs = run_recipe(
        srv,
        model_dir,
        [
            str(HERE / "test_tinker_cookbook.py"),
            "sl_basic",
            f"model_name={model_dir}",
            f"renderer_name={RENDERER}",
            f"log_path={log}",
            f"max_steps={steps}",
            f"batch_size={batch}",
            "lora_rank=32",
        ],
    )
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return [r["train_mean_nll"] for r in rows if "train_mean_nll" in r], secs


def math_rl(
    srv,
    model_dir: Path,
    log: Path,
    loss_fn: str | None,
    steps: int = 3,
    groups: int = 8,
    group_size: int = 4,
    extra: tuple[str, ...] = (),
) -> tuple[list[dict], float]:
    """Per step the env metrics (reward/total, correct, format), and the run's seconds. `extra`:
    more of the recipe's CLI values."""
    args = [
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={model_dir}",
        f"renderer_name={RENDERER}",
        "env=arithmetic",
        f"group_size={group_size}",
        f"groups_per_batch={groups}",
        f"max_steps={steps}",
        "lora_rank=16",
        "learning_rate=3e-4",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        "eval_every=0",
        "save_every=0",
    ]
    if loss_fn:
        args.append(f"loss_fn={loss_fn}")
    secs = run_recipe(srv, model_dir, args + list(extra))
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k.removeprefix("env/all/"): r[k]
            for k in ("env/all/reward/total", "env/all/correct", "env/all/format")
        }
        for r in rows
        if "env/all/reward/total" in r
    ], secs


def _serve_default(home: Path):
    """The slow tier's SmolLM2 server (tests/server/test_tinker_recipes.py) and the model's directory."""
    sys.path.insert(0, str(HERE))
    from test_tinker_recipes import _serve_default as serve_smollm2

    from trine.engine.model.default_model import ensure_default_model

    ctx, _ = serve_smollm2(home)
    return ctx, ensure_default_model()


@pytest.mark.slow
def test_cookbook_sl_basic_and_math_rl_run_unmodified_on_smollm2(tmp_path):
    pytest.importorskip(
        "tinker_cookbook",
        reason="tinker-cookbook is not installed: `make test-slow` "
        "installs it (pip --no-deps tinker-cookbook==0.6.1 plus its dependencies)",
    )
    ctx, model_dir = _serve_default(tmp_path / "home")
    with ctx as srv:
        nll, _ = sl_basic(srv, model_dir, tmp_path / "sl_basic")
        assert len(nll) == 6 and nll[-1] < nll[0], nll
        for loss in ("importance_sampling", None):  # None: the recipe's default, stable_reinforce
            steps, _ = math_rl(srv, model_dir, tmp_path / f"math_rl_{loss}", loss)
            assert len(steps) == 3 and all(-0.1 <= s["reward/total"] <= 1.0 for s in steps), steps


ASYNC = ("max_steps_off_policy=1",)  # math_rl's async config: sampling overlaps training


@pytest.mark.slow
def test_cookbook_math_rl_async_runs_unmodified_on_smollm2(tmp_path):
    pytest.importorskip(
        "tinker_cookbook",
        reason="tinker-cookbook is not installed: `make test-slow` "
        "installs it (pip --no-deps tinker-cookbook==0.6.1 plus its dependencies)",
    )
    ctx, model_dir = _serve_default(tmp_path / "home")
    with ctx as srv:
        steps, _ = math_rl(srv, model_dir, tmp_path / "math_rl_async", None, extra=ASYNC)
        assert len(steps) == 3 and all(-0.1 <= s["reward/total"] <= 1.0 for s in steps), steps


if __name__ == "__main__":
    if sys.argv[1:2] == ["sl_basic"]:
        sl_basic_main(sys.argv[2:])
        sys.exit(0)
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    ctx, model_dir = _serve_default(tmp / "home")
    with ctx as srv:
        nll, secs = sl_basic(srv, model_dir, tmp / "sl_basic")
        print("sl_basic train_mean_nll per step:", [round(x, 3) for x in nll], f"({secs:.0f} s)", flush=True)
        for loss in ("importance_sampling", None):
            steps, secs = math_rl(srv, model_dir, tmp / f"math_rl_{loss}", loss)
            print(
                f"math_rl arithmetic loss_fn={loss or 'stable_reinforce (default)'}:",
                steps,
                f"({secs:.0f} s)",
                flush=True,
            )
        steps, secs = math_rl(srv, model_dir, tmp / "math_rl_async", None, extra=ASYNC)
        print(f"math_rl arithmetic async ({' '.join(ASYNC)}):", steps, f"({secs:.0f} s)", flush=True)
