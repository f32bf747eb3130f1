"""A split reduction's second kernel is checked on the sums its first computes (``smg.reference.produced_inputs``),
in the offline batch (``inputs_from`` in the manifest) as in a runner (``MeasureInput.inputs_from``)."""

from __future__ import annotations

import numpy as np
import pytest

from schedulers.hardware import H100
from schedulers.split import decide_split
from smg import patterns
from smg.errors import ShapeError
from smg.reference import evaluate, produced_inputs, random_inputs
from smg.serialize import smg_to_dict


def _split_group_norm():
    whole = patterns.group_norm(2, 64, 32, 2560, act="silu", dtype="float16")
    split = decide_split(whole, H100, one_kernel_max_row=0)  # rows of 5120 elements: one kernel by default
    assert not isinstance(split, str), split
    partial, stats, apply = split.kernels
    return whole, partial, stats, apply


def test_a_stats_kernel_on_its_partials_sums_gives_the_whole_group_norm_back() -> None:
    """SD 1.5 UNet's 8x8x2560 GroupNorm + SiLU, split: stats on the partial's sums of an image, then apply on
    that image, is the unsplit GroupNorm of it; on random 'sums' the variance goes negative (NaN)."""
    whole, partial, stats, apply = _split_group_norm()
    xw = random_inputs(whole, 0)
    xs = produced_inputs(stats, partial, 0)
    assert np.array_equal(random_inputs(partial, 0)["X"].ravel(), xw["X"].ravel())  # the same image
    for n in ("W", "B"):
        xs[n] = xw[n].reshape(stats.shape(n))
    st = evaluate(stats, xs)
    xa = {"X": xw["X"].reshape(apply.shape("X"))}
    xa |= {n: st[n].reshape(apply.shape(n)).astype(np.float32) for n in ("Y_scale0", "Y_shift0")}
    got = evaluate(apply, xa)["Y"].ravel()
    np.testing.assert_allclose(got, evaluate(whole, xw)["Y"].ravel(), rtol=1e-5, atol=1e-5)
    noise = random_inputs(stats, 0) | {n: xs[n] for n in ("W", "B")}
    with np.errstate(invalid="ignore"):
        assert not np.isfinite(evaluate(stats, noise)["Y_scale0"]).all()


def test_the_batchs_references_and_runners_take_the_producer() -> None:
    from search.records import MeasureInput
    from spacefusion.runtime.batch import References

    _, partial, stats, _ = _split_group_norm()
    refs = References()
    smg, x, ref = refs.get(smg_to_dict(stats), 3, smg_to_dict(partial))  # as a manifest entry holds them
    want = produced_inputs(stats, partial, 3)
    assert smg.key == stats.key and all(np.array_equal(x[n], want[n]) for n in want)
    assert all(np.isfinite(v).all() for v in ref.values())
    with np.errstate(invalid="ignore"):  # random "sums": a negative variance's square root
        _, plain, _ = refs.get(stats, 3)
    assert not np.array_equal(plain["N_sum_p"], x["N_sum_p"])  # cached apart from the random inputs
    assert MeasureInput.__dataclass_fields__["inputs_from"].default is None


def test_a_producer_whose_outputs_it_does_not_read_is_refused_by_name() -> None:
    _, partial, stats, _ = _split_group_norm()
    other = patterns.gemm_epilogue(8, 8, 8)
    with pytest.raises(ShapeError, match="reads none of"):
        produced_inputs(stats, other, 0)
