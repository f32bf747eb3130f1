"""A forward whose backward cannot be derived raises BackwardError naming the op and the mapping, before any
lowering (never a TVM traceback)."""

from __future__ import annotations

import pytest

from smg import patterns
from smg.autodiff import derive_backward
from smg.errors import BackwardError, SpaceFusionError
from smg.ops import Builder


def test_a_max_that_is_no_stabiliser() -> None:
    g = Builder("rowmax", "float32")
    x = g.input("X", {"m": 4, "n": 8})
    smg = g.build(g.reduce(x, "n", "max", name="Y"))
    with pytest.raises(BackwardError, match=r"op 'Y' \(reduce_max\) is an All-to-One max over \('n',\).*no "
                                            r"stabiliser.*output\(s\) \['Y'\] change"):
        derive_backward(smg)


def test_a_kink_is_named() -> None:
    with pytest.raises(BackwardError, match=r"op 'Y' \(relu\).*kink"):
        derive_backward(patterns.gemm_epilogue(4, 4, 4, act="relu", dtype="float32"))


def test_a_windowed_mapping_is_named() -> None:
    smg = patterns.depthwise_conv2d(1, 6, 6, 4, kernel=3, dtype="float32")
    with pytest.raises(BackwardError, match=r"reads 'X' at .*windowed mapping"):
        derive_backward(smg)


def test_unknown_input_and_no_dependence() -> None:
    smg = patterns.layernorm(4, 8, dtype="float32")
    with pytest.raises(BackwardError, match=r"'Z' is not an input of 'layernorm'"):
        derive_backward(smg, wrt=("Z",))
    assert issubclass(BackwardError, SpaceFusionError)
