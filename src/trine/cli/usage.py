"""`trine usage`: tokens and cost by phase, prefix-cache hit rate and diagnostics, from a server or a data
dir."""

from __future__ import annotations

from pathlib import Path

import click

from ..metering import remote
from ..metering.rates import RateCard, trine_home
from ..metering.report import GROUPINGS, Report, build_report, describe_runs, render
from ..metering.since import parse_since
from .output import console


@click.command()
@click.option("--session", "session_id", help="Only this session.")
@click.option("--run", "run_id", help="Only this training or sampling run.")
@click.option("--since", help="Only events since: unix seconds, an age (30m, 2h, 1d) or an ISO time (UTC).")
@click.option(
    "--by", type=click.Choice(GROUPINGS), help="One row per minute, hour, day, run, model or session."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data dir to read directly (default $TRINE_HOME or ~/.trine) when no server is given.",
)
@click.option("--key", "key_name", help="With --home: only this API key (id or name); default all keys.")
@click.option("--url", help="Read from this server (default $TRINE_BASE_URL).")
@click.option("--api-key", help="API key for --url (default $TRINE_API_KEY).")
@click.option(
    "--rates",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Price with this rate card TOML (on top of the shipped one and $TRINE_HOME/rates.toml).",
)
def usage(session_id, run_id, since, by, as_json, home, key_name, url, api_key, rates):
    """Usage by phase: prefill, cached prefill, sample, train (loss tokens vs computed), with cost."""
    try:
        report = _report(session_id, run_id, since, by, home, key_name, url, api_key, rates)
    except (ValueError, ConnectionError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(report.to_json(indent=2))
    else:
        render(report, console())


def _report(session_id, run_id, since, by, home, key_name, url, api_key, rates) -> Report:
    filters = {k: v for k, v in (("session", session_id), ("run", run_id), ("since", since)) if v}
    url = remote.server_url(url)
    if url is not None:
        key = remote.api_key(api_key)
        params = dict(session_id=session_id, run_id=run_id, since=since)
        if rates is None:  # priced by the server's own rate card
            return Report.from_dict(remote.get_json(url, key, "/api/trine/v1/usage", {**params, "by": by}))
        from ..metering.events import CacheDiagnostic, UsageEvent

        d = remote.get_json(url, key, "/api/trine/v1/usage/events", params)
        return build_report(
            [UsageEvent.from_dict(e) for e in d["events"]],
            by,
            RateCard.load(rates),
            [CacheDiagnostic.from_dict(x) for x in d["diagnostics"]],
            filters,
        )

    from ..store import Store

    home = home or trine_home()
    if not (home / "trine.db").is_file():
        raise FileNotFoundError(f"no trine.db in {home}: pass --home DIR (a server's data dir) or --url URL")
    store = Store(home, read_only=True)  # beside a live server: reads only, claims nothing
    try:
        keys = [k for k in store.keys() if key_name in (None, k.id, k.name)]
        if key_name is not None and not keys:
            raise ValueError(f"--key: no API key with id or name {key_name!r} in {home}")
        t = parse_since(since) if since else None
        kw = dict(session_id=session_id, run_id=run_id, since=t)
        events = [e for k in keys for e in store.usage_events(k.id, **kw)]
        diags = [d for k in keys for d in store.diagnostics(k.id, **kw)]
        runs = describe_runs(store, {e.run_id for e in events}) if by == "run" else None
    finally:
        store.close()
    return build_report(events, by, RateCard.load(rates, home=home), diags, filters, runs)
