"""The `trine` command. Each subcommand lives in its own module and is imported only when run, after
the engine's process settings are applied (`trine.engine.setup.configure()`), so they hold for any
engine the command starts."""

from __future__ import annotations

import importlib

import click

from trine.engine.setup import configure

# name -> (module, function): the module defines a click.Command named by `function`.
COMMANDS = {
    "serve": ("trine.cli.serve", "serve"),
    "keys": ("trine.cli.keys", "keys"),
    "demo": ("trine.cli.demo", "demo"),
    "usage": ("trine.cli.usage", "usage"),
    "estimate": ("trine.cli.estimate", "estimate"),
    "models": ("trine.cli.models", "models"),
    "checkpoints": ("trine.cli.checkpoints", "checkpoints"),
    "export": ("trine.cli.export", "export"),
    "adapters": ("trine.cli.adapters", "adapters"),
    "runs": ("trine.cli.runs", "runs"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        # before any command loads torch: OpenMP reads its wait settings when torch loads it
        configure()
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name == module:
                return None
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trine", prog_name="trine", message="%(prog)s %(version)s")
def main():
    """trine: a self-hosted engine for LLM post-training (PyTRIO protocol)."""


if __name__ == "__main__":
    main()
