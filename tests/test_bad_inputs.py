"""Bad inputs a new user tries (issue 29, item 5): each gets an error that names the problem, or a correct
result, never a silent wrong answer or a traceback from deep inside."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from smg import patterns
from smg.errors import DTypeError, ShapeError
from smg.ops import Builder
from smg.reference import evaluate, reduction_length
from smg.tolerance import assert_close
from spacefusion.api import build, random_inputs, schedule
from spacefusion.cli import main


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "bool"])
def test_integer_dtypes_are_refused_before_they_give_wrong_answers(dtype: str) -> None:
    """An int8 GEMM whose sums reach 3200 gave -128: integer spaces are refused where they are declared."""
    with pytest.raises(DTypeError, match=f"dtype '{dtype}' of 'gemm': integer types are not supported"):
        Builder("gemm", dtype)
    b = Builder("gemm", "float16")
    with pytest.raises(DTypeError, match=f"dtype '{dtype}' of 'A': integer types"):
        b.input("A", {"m": 4, "k": 4}, dtype=dtype)


def test_an_unknown_dtype_and_a_fractional_dim_are_named_at_once() -> None:
    with pytest.raises(DTypeError, match="unknown dtype 'float7' of 'x'; known: float16, bfloat16, float32"):
        Builder("x", "float7")
    b = Builder("x", "float16")
    with pytest.raises(ShapeError, match="dimension 'm' has size 2.5: sizes are whole numbers"):
        b.input("A", {"m": 2.5, "k": 4})
    with pytest.raises(ShapeError, match="dimension 'k' has size '4': sizes are whole numbers"):
        b.input("B", {"k": "4"})
    assert Builder("y", "float16").input("A", {"m": np.int64(4), "k": 4.0}).dims == ("m", "k")


def test_the_default_schedule_fits_a_short_serial_dim() -> None:
    """16 keys: the default step (32) shrinks to the dim, and the kernel matches the numpy reference."""
    g = patterns.attention(1, 2, 16, 16, 64, dtype="float32")
    s = schedule(g)
    assert s.step == 16
    x = random_inputs(g, seed=0)
    assert_close(build(s, "llvm")(x)["O"], evaluate(g, x)["O"], "float32", reduction_length(g), "O")
    with pytest.raises(ScheduleError, match="step 2.5 for serial dim 'l' must be a whole number"):
        schedule(g, step=2.5)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("step", 0, "step 0 for serial dim 'l' must be 1..64"),
    ("step", -5, "step -5 for serial dim 'l' must be 1..64"),
    ("block", [["b", 1], ["h", 1], ["m", 0]], "tile 0 for dim 'm' must be 1..64"),
    ("stages", 0, "stages 0 must be 1..8"),
])
def test_a_schedule_file_with_bad_numbers_is_refused_when_read(tmp_path, capsys, field, value, match) -> None:
    """These crashed ``build --schedule`` with a bare ZeroDivisionError or TVM's InternalError."""
    d = json.loads(schedule(patterns.attention(1, 2, 64, 64, 64)).to_json())
    d[field] = value
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_json(json.dumps(d))
    (tmp_path / "s.json").write_text(json.dumps(d))
    assert main(["build", "--schedule", str(tmp_path / "s.json"), "--out", str(tmp_path / "o")]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["tune", "attention", "--shape", "1", "2", "64", "64", "64", "--iters", "-1"], "--iters: -1 is less than 1"),
    (["tune", "attention", "--shape", "1", "2", "64", "64", "64", "--trials", "-5"], "--trials: -5 is less than 1"),
    (["build", "attention", "--shape", "1", "2", "64", "64", "64", "--tile-m", "0", "--out", "x"],
     "--tile-m: 0 is less than 1"),
    (["build", "attention", "--shape", "1", "2", "64", "64", "64", "--step", "two", "--out", "x"],
     "--step: 'two' is not a whole number"),
])
def test_command_line_numbers_out_of_range_are_usage_errors(capsys, argv, match) -> None:
    """``--trials -5`` did nothing and ``--tile-m 0`` was taken as the default, silently."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_build_for_llvm_checks_the_kernel_instead_of_crashing(tmp_path, capsys) -> None:
    """``CpuKernel`` has no artefact to save: the llvm build is built and checked against the reference."""
    assert main(["build", "attention", "--shape", "1", "2", "64", "64", "64", "--dtype", "float32",
                 "--target", "llvm", "--out", str(tmp_path / "o")]) == 0
    assert "llvm kernel built and run against the numpy reference" in capsys.readouterr().out


def test_importing_a_folder_without_a_batch_says_what_is_missing(tmp_path, capsys) -> None:
    assert main(["tune", "attention", "--shape", "1", "2", "64", "64", "64", "--runner", "llvm", "--trials", "1",
                 "--db", str(tmp_path / "t.db"), "--import-results", str(tmp_path)]) == 2
    assert f"--import-results {tmp_path}: no manifest.json there" in capsys.readouterr().err


def test_rmsnorm_before_a_gemm_fuses_into_one_kernel() -> None:
    """``rmsnorm(x) @ W`` was refused ("derived update for 'O' disagrees with the exact chain"): the check
    drew the streamed x**2 independently of x, so the sum of squares came out negative under the sqrt.  The
    derivation itself (the GEMM on x, the row's 1/rms applied after the loop) is right: one kernel, correct."""
    b = Builder("rms_gemm", "float32")
    x, w = b.input("X", {"m": 64, "k": 128}), b.input("W", {"n": 64, "k": 128})
    g = b.build(b.matmul(b.rmsnorm(x, "k"), w, reduce="k", name="O"))
    s = schedule(g)
    assert s.serial == "k" and dict(s.plan.finalize)["O"].count("sqrt") == 1
    xs = random_inputs(g, seed=0)
    assert_close(build(s, "llvm")(xs)["O"], evaluate(g, xs)["O"], "float32", reduction_length(g), "O")


def test_a_core_install_without_the_compiler_names_the_extra(monkeypatch, capsys, tmp_path) -> None:
    """The core install (IR, reference, GPU runtime) has no TVM: a command that lowers says which extra
    brings it, instead of a ModuleNotFoundError traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "tvm", None)  # as after ``pip install spacefusion`` without [tvm]
    assert main(["build", "gemm", "--shape", "8", "8", "8", "--target", "llvm", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "build needs the compiler, and 'tvm' is not installed: pip install 'spacefusion[tvm]'" in err
