"""The engine: models, sampler, trainer and the runtimes that host them (docs/architecture.md, "Layers").

Importing it sets nothing in the process: the settings an engine runs under (OpenMP's wait, the C
allocator's thresholds) are applied by `setup.configure()`, which the `trine` CLI calls at its entry
and every engine calls when it starts.
"""
