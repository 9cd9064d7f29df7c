"""Shared by the console tests (and docs/console_screenshots.py): a server with two keys, a short SFT
through the trine SDK whose results (losses, gradient norms, cycles, tokens) the console must show
exactly, and a headless Chromium driven by selenium with its sign-in and screenshot helpers."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from serverutil import serve

import trine as trio

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
    data = [
        trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in SEQS
    ]
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


# ---------------------------------------------------------------------------- the browser
WIDE, NARROW = (1280, 800), (420, 860)


@contextlib.contextmanager
def chromium(binary: str, driver_path: str):
    """A headless Chromium (selenium) with a 1280x800 window."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = binary
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={WIDE[0]},{WIDE[1]}",
    ):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, script: str, timeout: float = 20):
    """Poll a JS expression until it is truthy; returns its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def sign_in(driver, url: str, key: str) -> None:
    driver.get(f"{url}/console")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{url}/console")
    wait(driver, "document.getElementById('apikey')")
    driver.find_element("id", "apikey").send_keys(key)
    driver.find_element("id", "signin-submit").click()


def _viewport(driver, width: int, height: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    wait(driver, "new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")


def screenshots(driver, stem: Path) -> None:
    """`stem`.png with a 1280x800 viewport, `stem`-narrow.png at 420x860, `stem`-full.png: the whole
    page 1280 wide."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    for (w, h), suffix in ((WIDE, ""), (NARROW, "-narrow"), ((WIDE[0], 0), "-full")):
        if not h:  # lay out at full width first, then measure the page
            _viewport(driver, w, WIDE[1])
            h = driver.execute_script("return document.documentElement.scrollHeight")
        _viewport(driver, w, h)
        driver.save_screenshot(str(stem.parent / f"{stem.name}{suffix}.png"))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
