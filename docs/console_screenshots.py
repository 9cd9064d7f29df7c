"""Regenerate the console screenshots in docs/ from a real job: the demo's SFT + GRPO stages (through
the SDK; the GRPO run logs its reward) on SmolLM2-135M-Instruct or --model DIR, then in headless
Chromium the GRPO run's page, the whole usage page and the Compare page (both runs' seconds per
step), 1280 wide.

    .venv/bin/python docs/console_screenshots.py [--model DIR] [--out docs] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from consoleutil import chromium, screenshots, sign_in, wait  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--keep", type=Path, help="also keep every screenshot (all pages, all sizes) here")
    ap.add_argument("--sft-steps", type=int, default=10)
    ap.add_argument("--rl-steps", type=int, default=4)
    args = ap.parse_args()

    from rich.console import Console

    import trine as trio
    from trine.cli.demo import run_job
    from trine.engine.model.default_model import ensure_default_model
    from trine.server.app import start_server

    model_dir = args.model or ensure_default_model()
    home = Path(tempfile.mkdtemp(prefix="trine-console-shots-"))
    shots = args.keep or home / "shots"
    server = start_server(models=[model_dir], home=home, port=0)
    try:
        with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as service:
            run_job(
                service,
                model_dir.name,
                sft_steps=args.sft_steps,
                rl_steps=args.rl_steps,
                console=Console(),
                seed=0,
            )
        runs, _ = server.service.store.training_runs()
        sft_run, grpo_run = sorted(runs, key=lambda r: r.created_at)[:2]
        with chromium(shutil.which("chromium"), shutil.which("chromedriver")) as driver:
            sign_in(driver, server.url, server.api_key)
            wait(driver, "document.querySelector('#runs table')")
            screenshots(driver, shots / "runs")
            driver.get(f"{server.url}/console/runs/{grpo_run.id}")
            wait(
                driver,
                f"Chart.getChart('chart-metric-reward') && "
                f"Chart.getChart('chart-metric-reward').data.labels.length === {args.rl_steps}",
            )
            screenshots(driver, shots / "run")
            driver.get(f"{server.url}/console/compare?runs={sft_run.id},{grpo_run.id}&metric=seconds")
            wait(
                driver,
                "Chart.getChart('chart-compare') && "
                "Chart.getChart('chart-compare').data.datasets.length === 2",
            )
            screenshots(driver, shots / "compare")
            for page in ("usage", "server", "checkpoints"):
                driver.get(f"{server.url}/console/{page}")
                wait(driver, "document.querySelector('main table, main .empty')")
                screenshots(driver, shots / page)
        args.out.mkdir(parents=True, exist_ok=True)
        # (docs/console-checkpoints.png is the browser test's: here the runs have ended, and with them
        # their temporary snapshots)
        for page, shot in (("run", "run-full.png"), ("usage", "usage-full.png"), ("compare", "compare.png")):
            shutil.copy(shots / shot, args.out / f"console-{page}.png")
            print(f"wrote {args.out / f'console-{page}.png'}")
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
