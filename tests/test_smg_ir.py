"""The SMG IR: immutability, stable content keys, joins, errors and printing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import smg
from smg import (
    SMG,
    Access,
    Builder,
    DataSpace,
    Dim,
    Edge,
    Kind,
    Op,
    ShapeError,
    SpaceFusionError,
    UnknownAxisError,
    UnknownOperatorError,
    evaluate,
    join_smgs,
)
from smg.hashing import canonical
from smg.workloads import gemm, mha, simplified_mha, softmax_gemm

REPO = Path(__file__).resolve().parents[1]
HEX64 = re.compile(r"[0-9a-f]{64}")


def small_graph(op: str = "add", size: int = 4, dtype: str = "float32") -> SMG:
    b = Builder("small", dtype)
    x = b.input("x", {"m": size, "l": 3})
    y = b.input("y", {"m": size})
    return b.build(b.binary(op, x, y, name="z"))


# -- immutability -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "attr", "value"),
    [
        (Dim("m", 4), "size", 5),
        (DataSpace("x", ("m",)), "dtype", "float16"),
        (Access("x", ("m",)), "index", ("l",)),
        (Op("exp", "y", ("m",), (Access("x", ("m",)),), "exp(x)"), "body", "log(x)"),
        (Edge("x", "y.it", (("m", Kind.ONE_TO_ONE),)), "dst", "z"),
    ],
)
def test_ir_nodes_are_frozen(obj: object, attr: str, value: object) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, attr, value)


def test_smg_is_frozen() -> None:
    g = gemm(2, 3, 4)
    for attr, value in [("name", "other"), ("dims", ()), ("ops", ()), ("outputs", ("A",))]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(g, attr, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.ops[0].combiner = "max"  # type: ignore[misc]
    with pytest.raises(TypeError):
        g.dims[0] = Dim("m", 9)  # type: ignore[index]
    assert g.dim_sizes == {"m": 2, "n": 3, "k": 4}


def test_tensor_handle_is_frozen() -> None:
    b = Builder("t")
    x = b.input("x", {"m": 2, "k": 3})
    assert x.shape == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.name = "y"  # type: ignore[misc]


# -- content keys -----------------------------------------------------------------------------


def test_key_is_sha256_hex() -> None:
    g = mha(1, 2, 3, 4, 8)
    assert HEX64.fullmatch(g.key)
    text = json.dumps(canonical(g), sort_keys=True, separators=(",", ":"))
    assert g.key == hashlib.sha256(text.encode()).hexdigest()


def test_key_equal_for_independently_built_graphs() -> None:
    a, b = mha(1, 2, 3, 4, 8), mha(1, 2, 3, 4, 8)
    assert a is not b
    assert a == b
    assert a.key == b.key
    assert small_graph().key == small_graph().key
    assert simplified_mha(5, 4).key == simplified_mha(5, 4).key


def test_key_changes_with_size_dtype_and_op() -> None:
    base = small_graph()
    keys = {
        base.key,
        small_graph(size=5).key,
        small_graph(dtype="float16").key,
        small_graph(op="sub").key,
        small_graph(op="mul").key,
    }
    assert len(keys) == 5
    assert gemm(4, 5, 6).key != gemm(4, 5, 7).key
    assert gemm(4, 5, 6).key != gemm(4, 5, 6, dtype="float16").key
    assert mha(1, 2, 3, 4, 8).key != mha(1, 2, 3, 4, 8, scale=0.5).key
    assert softmax_gemm(2, 3, 4).key != softmax_gemm(2, 3, 4, dtype="float32").key


_KEY_SCRIPT = (
    "from smg.workloads import gemm, mha, simplified_mha;"
    "print(gemm(4, 5, 6).key, mha(1, 2, 3, 4, 8).key, simplified_mha(5, 4).key)"
)


def test_key_stable_across_processes() -> None:
    here = [gemm(4, 5, 6).key, mha(1, 2, 3, 4, 8).key, simplified_mha(5, 4).key]
    seen = []
    for hashseed in ("0", "4242"):  # different str hashing: keys must not depend on hash()
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED=hashseed)
        out = subprocess.run(
            [sys.executable, "-c", _KEY_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
            check=True, timeout=60,
        )
        seen.append(out.stdout.split())
    assert seen[0] == here
    assert seen[1] == here


# -- join -------------------------------------------------------------------------------------


def _producer_graph(m: int = 4) -> SMG:
    b = Builder("prod")
    x = b.input("X", {"m": m, "k": 3})
    w = b.input("W", {"k": 3, "n": 5})
    return b.build(b.matmul(x, w, reduce="k", name="Y"))


def _consumer_graph(m: int = 4) -> SMG:
    b = Builder("cons")
    y = b.input("Y", {"m": m, "n": 5})
    return b.build(b.unary("relu", y, name="Z"))


def test_join_on_shared_dims_and_spaces() -> None:
    p, c = _producer_graph(), _consumer_graph()
    j = p.join(c)
    assert j.name == "prod+cons"
    assert j.dim_sizes == {"m": 4, "k": 3, "n": 5}
    assert [op.out for op in j.ops] == ["Y", "Z"]
    assert j.inputs == ("X", "W")
    assert j.intermediates == ("Y",)
    assert j.outputs == ("Z",)  # Y is read by Z, so it is no longer an output
    assert j.producer("Y") is not None and j.consumers("Y") == (j.producer("Z"),)
    assert len(j.edges) == len(p.edges) + len(c.edges)
    assert j.join(c, name="again").ops == j.ops  # ops are deduplicated by content

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    got = evaluate(j, {"X": x, "W": w})["Z"]
    np.testing.assert_allclose(got, np.maximum(x @ w, 0.0), rtol=1e-12, atol=1e-12)


def test_join_smgs_explicit_outputs() -> None:
    j = join_smgs([_producer_graph(), _consumer_graph()], "fused", outputs=("Y", "Z"))
    assert j.outputs == ("Y", "Z") and j.intermediates == ()


def test_join_mismatched_dim_size_raises() -> None:
    with pytest.raises(ShapeError, match=r"dimension 'm' is 4 in one graph and 6"):
        _producer_graph(4).join(_consumer_graph(6))


def test_join_mismatched_space_dims_raises() -> None:
    b = Builder("cons2")
    y = b.input("Y", {"n": 5, "m": 4})  # same name, other layout
    other = b.build(b.unary("exp", y, name="Z"))
    with pytest.raises(ShapeError, match="'Y'"):
        _producer_graph().join(other)


def test_smg_validation_errors() -> None:
    with pytest.raises(ShapeError, match="'m'"):
        SMG("bad", (Dim("m", 2), Dim("m", 3)), (), (), ())
    with pytest.raises(UnknownAxisError, match="'q'"):
        SMG("bad", (Dim("m", 2),), (DataSpace("x", ("q",)),), (), ())
    with pytest.raises(UnknownAxisError, match="'nope'"):
        SMG("bad", (Dim("m", 2),), (DataSpace("x", ("m",)),), (), ("nope",))
    op = Op("exp", "y", ("m",), (Access("ghost", ("m",)),), "exp(ghost)")
    with pytest.raises(UnknownAxisError, match="'ghost'"):
        SMG("bad", (Dim("m", 2),), (DataSpace("y", ("m",)),), (op,), ("y",))
    with pytest.raises(UnknownAxisError, match="'ghost'"):
        gemm(2, 3, 4).space("ghost")
    with pytest.raises(UnknownAxisError, match="'ghost'"):
        gemm(2, 3, 4).ops[0].access("ghost")


def test_dim_validation() -> None:
    with pytest.raises(ShapeError, match="'m'"):
        Dim("m", 0)
    with pytest.raises(ValueError, match="not an identifier"):
        Dim("1m", 3)


# -- builder errors ---------------------------------------------------------------------------


def test_matmul_mismatched_dim_raises_shape_error() -> None:
    b = Builder("mm")
    b.input("A", {"m": 2, "k": 3})
    with pytest.raises(ShapeError, match="'k'"):
        b.input("B", {"k": 4, "n": 2})


def test_binary_mismatched_dim_raises_shape_error() -> None:
    b = Builder("bin")
    b.input("x", {"m": 2, "l": 3})
    with pytest.raises(ShapeError, match="'l'"):
        b.input("y", {"l": 7})


def test_tensors_from_other_graph_rejected() -> None:
    b1, b2 = Builder("one"), Builder("two")
    x = b1.input("x", {"m": 2})
    y = b2.input("y", {"m": 2})
    with pytest.raises(ValueError, match="'y'"):
        b1.binary("add", x, y)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda b, x: b.unary("cosh_nope", x), "cosh_nope"),
        (lambda b, x: b.binary("pow_nope", x, x), "pow_nope"),
        (lambda b, x: b.reduce(x, "l", "mean"), "mean"),
    ],
)
def test_unknown_operator(call, name: str) -> None:
    b = Builder("u")
    x = b.input("x", {"m": 2, "l": 3})
    with pytest.raises(UnknownOperatorError) as info:
        call(b, x)
    assert f"'{name}'" in str(info.value)
    assert isinstance(info.value, SpaceFusionError)


def test_unknown_axis_in_reduce_and_matmul() -> None:
    b = Builder("ax")
    x = b.input("x", {"m": 2, "l": 3})
    y = b.input("y", {"l": 3, "n": 4})
    with pytest.raises(UnknownAxisError) as info:
        b.reduce(x, "q", "sum")
    assert "'q'" in str(info.value)
    with pytest.raises(UnknownAxisError) as info:
        b.matmul(x, y, reduce="n")  # n is in y but not in x
    assert "'n'" in str(info.value) and "'x'" in str(info.value)
    with pytest.raises(UnknownAxisError) as info:
        b.matmul(x, y, reduce="z")
    assert "'z'" in str(info.value)


def test_evaluate_wrong_input_shape() -> None:
    g = gemm(2, 3, 4)
    with pytest.raises(ShapeError, match=r"input 'B' has shape \(4, 3\)"):
        evaluate(g, {"A": np.zeros((2, 4)), "B": np.zeros((4, 3))})
    with pytest.raises(KeyError, match="'B'"):
        evaluate(g, {"A": np.zeros((2, 4))})


def test_builder_build_without_ops() -> None:
    b = Builder("empty")
    b.input("x", {"m": 2})
    with pytest.raises(ValueError, match="no operators"):
        b.build()


def test_builder_rejects_duplicate_space_names() -> None:
    b = Builder("dup")
    x = b.input("x", {"m": 2})
    b.unary("exp", x, name="y")
    with pytest.raises(ValueError, match="'y'"):
        b.unary("log", x, name="y")


def test_builder_fresh_names() -> None:
    b = Builder("fresh")
    x = b.input("x", {"m": 2})
    names = [b.unary("exp", x).name for _ in range(3)]
    assert names == ["exp0", "exp1", "exp2"]


# -- printing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "g", [gemm(4, 5, 6), mha(1, 2, 3, 4, 8), softmax_gemm(2, 3, 4), simplified_mha(4, 3)],
    ids=["gemm", "mha", "softmax_gemm", "simplified_mha"],
)
def test_str_summary(g: SMG) -> None:
    text = str(g)
    assert g.name in text and g.key[:12] in text
    for d in g.dims:
        assert f"{d.name}={d.size}" in text
    for s in g.spaces:
        assert re.search(rf"\b{s.name}\[", text), s.name
    for op in g.ops:
        assert op.iteration_space in text
    counts = g.count_kinds()
    for k, v in counts.items():
        assert f"{k.value}={v}" in text


def test_str_summary_fig1_counts() -> None:
    text = str(simplified_mha(4, 3))
    assert "One-to-All=6" in text and "All-to-One=4" in text
    assert "Query -> QK.it  l:1:A" in text


def test_public_api_exports() -> None:
    for name in smg.__all__:
        assert hasattr(smg, name), name


def test_join_rejects_two_producers_of_one_space() -> None:
    b = Builder("other")
    t = b.input("T", {"m": 4, "n": 5})
    other = b.build(b.unary("exp", t, name="Y"))  # also writes Y, differently
    with pytest.raises(ValueError, match="'Y'"):
        _producer_graph().join(other)
