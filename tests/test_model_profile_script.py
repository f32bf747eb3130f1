"""experiments/model_profile.py: the conv keys both sides are joined on, and the idle time of a timeline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import model_profile  # noqa: E402


def test_an_exported_conv_and_torchs_conv_of_one_shape_get_one_key() -> None:
    from smg import patterns

    cases = [  # (our SMG, the nn.Conv2d torch runs, its input)
        (patterns.conv2d(2, 16, 16, 64, 32, 3, 1, 1, residual=True), torch.nn.Conv2d(64, 32, 3, padding=1),
         (2, 64, 16, 16)),
        (patterns.conv2d(2, 16, 16, 64, 32, 3, 2, 1), torch.nn.Conv2d(64, 32, 3, stride=2, padding=1),
         (2, 64, 16, 16)),
        (patterns.conv2d(2, 8, 8, 64, 32, 1, 1, 0), torch.nn.Conv2d(64, 32, 1), (2, 64, 8, 8)),
        (patterns.conv2d(2, 8, 8, 64, 32, 3, 1, 1, upsample=2), torch.nn.Conv2d(64, 32, 3, padding=1),
         (2, 64, 16, 16)),
        (patterns.upsample_conv2d(2, 8, 8, 64, 32), torch.nn.Conv2d(64, 32, 3, padding=1), (2, 64, 16, 16)),
    ]
    keys = set()
    for smg, conv, shape in cases:
        ours = model_profile.conv_key_of_workload(smg.name, smg.dim_sizes)
        x = torch.zeros(shape)
        assert ours == model_profile._conv_key_of_module(conv, x), smg.name
        assert ours[4] == conv(x).shape[-1]
        # Inductor's cuDNN call, its arguments by position and by name, gets the module's key
        pos = (x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, False, (0, 0), 1)
        named = {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}
        assert tuple(model_profile._conv_key_of_call(pos, {})) == ours
        assert tuple(model_profile._conv_key_of_call((x, conv.weight, None), named)) == ours
        keys.add(ours)
    # both upsampling forms are torch's conv over the upsampled 16x16 image, as the first case (a residual
    # add is not part of a key: torch adds it apart)
    assert len(keys) == 3
    assert model_profile.conv_key_of_workload("group_norm_silu.apply", {"n": 2}) is None


def test_idle_time_counts_overlapping_kernels_once() -> None:
    tl = [("a", 0.0, 10.0), ("b", 8.0, 12.0), ("c", 15.0, 20.0), ("d", 20.5, 21.0)]
    got = model_profile.gaps(tl)
    assert got["span_us"] == 21.0 and got["busy_us"] == 17.5 and got["idle_us"] == 3.5
    assert got["largest"][0] == (3.0, "b", "c") and got["gaps_by_us"] == {"<1": 1, "1-2": 0, "2-5": 1,
                                                                          "5-20": 0, ">=20": 0}


def test_the_script_refuses_an_export_without_kernels(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        model_profile.main([str(tmp_path)])


def test_our_convs_are_summed_by_key_and_by_kernel() -> None:
    shape = {"n": 2, "h": 16, "w": 16, "c": 64, "m": 512, "k": 576, "co": 32}
    kernels = {"sf_a": {"workload": {"name": "conv2d_3x3_res_none", "shape": shape}},
               "sf_b": {"workload": {"name": "conv2d_3x3_none", "shape": shape}},
               "sf_gn": {"workload": {"name": "group_norm_silu.apply", "shape": {"n": 2}}}}
    tl = [("sf_a", 0.0, 5.0), ("sf_gn", 5.0, 6.0), ("sf_b", 6.0, 8.0), ("sf_a", 8.0, 12.0), ("cudnn", 12.0, 20.0)]
    got = model_profile.our_convs(tl, kernels)
    assert got == {(2, 64, 32, 3, 16, 1): [11.0, 3, {"sf_a": [9.0, 2], "sf_b": [2.0, 1]}]}
