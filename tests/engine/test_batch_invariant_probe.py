"""`--batch-invariant` checks, once a process, that the kernels it builds on keep their bits here."""

from __future__ import annotations

import logging

import torch

from trine.engine.model import invariant


def test_the_kernels_keep_their_bits_on_this_kernel_path(caplog):
    """On this CPU's kernel path (and, in `make test-portable`, its second one) a row's bits do not
    depend on its place in a ROW_TILE-row GEMM, and enabling the kernels warns of nothing."""
    invariant.enable(True)
    try:
        assert invariant.rows_invariant()
        assert "--batch-invariant" not in caplog.text
    finally:
        invariant.enable(False)


def test_a_gemm_that_rounds_rows_by_their_place_is_named_at_enable(monkeypatch, caplog):
    """A GEMM that computes the rows past some block boundary another way (MKL's AVX2 path did so for
    the last 2 rows of a 32-row call) fails the probe, and `enable` says so, naming the kernel path,
    rather than letting bit-for-bit claims silently fail."""
    real = torch.nn.functional.linear

    def rows_by_place(x, w, b=None):
        out = real(x, w, b)
        if x.shape[0] > 2:  # the last two rows summed in another order: other last bits
            out[-2:] = real(x[-2:].flip(-1), w.flip(-1), b)
        return out

    monkeypatch.setattr(invariant.F, "linear", rows_by_place)
    invariant.rows_invariant.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            invariant.enable(True)
        assert not invariant.rows_invariant()
        assert "--batch-invariant" in caplog.text and "kernel path: ATen" in caplog.text
    finally:
        invariant.enable(False)
        monkeypatch.undo()
        invariant.rows_invariant.cache_clear()
