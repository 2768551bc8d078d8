"""FastModel at TP=2 (two gloo ranks, each building only its slices) against the reference at TP=1, and rank ==
rank bit for bit (every reduction sums in rank order on every rank). CPU: interpreted child processes on the
slimmed tiny model (see test_runtime_fast.py); the same schedule and checks as TP=1."""

from __future__ import annotations

import pytest
import torch

from test_runtime_fast import ARGMAX_MIN, check_choices, check_logits, interpreted, lite_dir  # noqa: F401


def _check_tp2(ranks, what):
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.equal(a, b), "the ranks' logits differ"
    check_choices(ranks[0], what)
    check_logits(ranks[0], what)
    assert ranks[0]["argmax"] >= ARGMAX_MIN


def test_interpreted_parity_tp2(lite_dir, tmp_path):  # noqa: F811
    """One decode step after the prefill, not TP=1's two: the TP-specific work (each rank's slices, the rank-order
    reductions and gathers) is the same code in every decode step, and the first one already runs it over caches a
    prefill wrote; a decode reading caches a decode wrote is TP=1's second step (test_runtime_fast.py), the same
    per-rank code. Every row of both steps is still checked: the ranks' logits bitwise, the choices and logits
    against the reference."""
    ranks = interpreted(lite_dir, False, tmp_path, world=2, decode_steps=1)
    assert len(ranks[0]["logits"]) == 2  # the prefill and one decode step
    _check_tp2(ranks, "CPU TP=2 fake quant off")


@pytest.mark.gpu
def test_gpu_parity_tp2(tiny_model_dir, tmp_path):
    """Both ranks on the one GPU (gloo), the built-in tiny model."""
    _check_tp2(interpreted(tiny_model_dir, False, tmp_path, world=2, device="cuda"), "GPU TP=2 fake quant off")
