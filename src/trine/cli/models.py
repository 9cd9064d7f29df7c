"""`trine models`: the model list with per-phase prices, from a server or from the rate card + data dir,
and the real models trine can build (engine/model/default_model.py) with their licenses."""

from __future__ import annotations

from pathlib import Path

import click

from ..metering import remote
from ..metering.rates import FULL_SUFFIX, RateCard, trine_home
from .output import Column, price, print_json, print_table


@click.command()
@click.option("--url", help="List a server's models (default $TRINE_BASE_URL).")
@click.option("--api-key", help="API key for --url (default $TRINE_API_KEY).")
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data dir whose models/ and rates.toml apply (default $TRINE_HOME or ~/.trine).",
)
@click.option(
    "--rates", type=click.Path(dir_okay=False, path_type=Path), help="Rate card TOML to price with."
)
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def models(url, api_key, home, rates, as_json):
    """Models with their prices per million tokens: prefill, cached prefill, sample, train (LoRA, and
    full fine-tuning's from the model's `:full` rate row); storage per GB-month; and the license of
    each real model trine builds from PyPI."""
    try:
        rows = _rows(url, api_key, home, rates)
    except (ValueError, ConnectionError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(rows)
        return
    cols = [Column("model", fold=True), Column("status", fold=True), Column("license", fold=True)]
    names = ("prefill", "cached", "sample", "train", "train full", "GB-month")
    cols += [Column(name, numeric=True) for name in names]
    keys = ("prefill", "prefill_cached", "sample", "train", "train_full", "storage_gb_month")
    table = []
    for r in rows:
        p = r["pricing"]
        status = r["status"] + ("" if p["rate_row"] == r["name"] else f" (priced as {p['rate_row']})")
        table.append((r["name"], status, r.get("license") or "", *(price(p.get(k)) for k in keys)))
    print_table("models (USD per million tokens; storage per GB-month)", cols, table, empty="no models")


def _rows(url, api_key, home, rates) -> list[dict]:
    """One entry per model: name (what clients pass as base_model), model_id (a server's model
    directory), status (served / downloaded / built on first use / rate card), license (a real
    model's; None for other checkpoints), pricing."""
    from ..engine.model.default_model import DEFAULT_MODEL_NAME, REAL_MODELS

    url = remote.server_url(url)
    if url is not None:
        key = remote.api_key(api_key)
        card = None
        out = []
        for item in remote.models(url, key):
            pricing = item.get("pricing")
            if pricing is None:  # a server that does not price its catalogue: use its rate card endpoint
                if card is None:
                    d = remote.get_json(url, key, "/api/trine/v1/rates")
                    card = RateCard.from_models_list(d["models"], d["currency"])
                pricing = card.pricing(item["model_id"])
            out.append(
                {
                    "name": item.get("alias") or item["model_id"],
                    "model_id": item["model_id"],
                    "status": "served",
                    "license": item.get("license"),
                    "pricing": pricing,
                }
            )
        return out
    home = home or trine_home()
    card = RateCard.load(rates, home=home)
    local = sorted(p.name for p in (home / "models").glob("*") if (p / "config.json").is_file())

    def row(name: str, status: str, pricing: dict) -> dict:
        real = REAL_MODELS.get(name)
        if real is not None and status != "downloaded":  # built from its wheels on first use
            default = " (the default)" if name == DEFAULT_MODEL_NAME else ""
            status = f"built on first use{default}"
        row = {"name": name, "model_id": name, "status": status, "license": real and real.license}
        if real is not None:
            row |= {"license_url": real.license_url, "download": real.download}
        return row | {"pricing": pricing}

    out = [row(m, "downloaded", card.pricing(m)) for m in local]
    out += [row(m, "real model", card.pricing(m)) for m in REAL_MODELS if m not in local]
    out += [
        row(m["model_id"], "rate card", m["pricing"])
        for m in card.as_models_list()
        if m["model_id"] not in local
        and m["model_id"] not in REAL_MODELS
        and not m["model_id"].endswith(FULL_SUFFIX)  # a price, not a model
    ]
    return out
