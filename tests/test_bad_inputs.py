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


def _edit_tile_on_reduced(d: dict) -> None:
    d["block"].append(["l", 8])


def _edit_serial(d: dict) -> None:
    d["serial"] = "d"


def _edit_finalize(d: dict) -> None:
    d["plan"]["finalize"][0][1] += "*2"


def _edit_update(d: dict) -> None:
    d["plan"]["states"][0]["carry"] = "0"


def _edit_level(d: dict) -> None:
    d["memory"] = [[n, "shared" if lvl == "register" else lvl] for n, lvl in d["memory"]]


def _edit_spatial(d: dict) -> None:
    d["spatial"] = [dict(x, cut=True) for x in d["spatial"]]


@pytest.mark.parametrize(("edit", "match"), [
    (_edit_tile_on_reduced, "does not fit its graph 'attention': dim 'l' cannot be cut spatially"),
    (_edit_serial, "does not fit its graph 'attention'"),
    (_edit_finalize, "the slicers derive other temporal plan .* \\(in finalize\\)"),
    (_edit_update, "the slicers derive other temporal plan .* \\(in states\\)"),
    (_edit_level, "cannot move from 'register' to 'shared'"),
    (_edit_spatial, "the slicers derive other spatial decisions"),
], ids=["tile on the reduced dim", "serial dim", "finalize", "update function", "memory level", "spatial"])
def test_a_schedule_file_that_does_not_fit_its_graph_is_refused(tmp_path, capsys, edit, match) -> None:
    """Each of these edits built a kernel that was wrong (every output, or differently on each call), and
    ``build --schedule`` wrote it for CUDA with exit 0: the file must be what the slicers make of its graph."""
    s = schedule(patterns.attention(1, 2, 64, 64, 64))
    d = json.loads(s.to_json())
    assert Schedule.from_json(json.dumps(d)) == s  # the file as written loads
    edit(d)
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_json(json.dumps(d))
    (tmp_path / "s.json").write_text(json.dumps(d))
    assert main(["build", "--schedule", str(tmp_path / "s.json"), "--target", "cuda:sm_90a",
                 "--out", str(tmp_path / "o")]) == 2
    assert "schedule JSON" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_plan_printed_otherwise_with_the_same_meaning_still_loads() -> None:
    """Another sympy may print a derived carry in another order: the file still replays what it recorded."""
    s = schedule(patterns.attention(1, 2, 64, 64, 64))
    d = json.loads(s.to_json())
    carried = next(u for u in d["plan"]["states"] if u["carry"])
    carried["carry"] = f"1*({carried['carry']}) + 0"
    d["plan"]["finalize"][0][1] = f"({d['plan']['finalize'][0][1]})*1"
    back = Schedule.from_json(json.dumps(d))
    assert back.plan.finalize == tuple(tuple(f) for f in d["plan"]["finalize"])


def test_a_schedule_file_may_move_levels_where_the_lowering_has_a_choice() -> None:
    """A staged input read from global memory instead is the lowering's choice, not an edit to refuse."""
    s = schedule(patterns.attention(1, 2, 64, 64, 64))
    d = json.loads(s.to_json())
    d["memory"] = [[n, "global" if lvl == "shared" and n in ("K", "V") else lvl] for n, lvl in d["memory"]]
    assert d["memory"] != json.loads(s.to_json())["memory"]
    assert Schedule.from_json(json.dumps(d)).level("K") == "global"


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


@pytest.mark.parametrize(("argv", "match"), [
    (["build", "attention", "--shape", "1", "2", "64", "64", "64", "--out", "{file}"], "a file is there, not a folder"),
    (["demo", "--out", "{file}"], "a file is there, not a folder"),
    (["build", "attention", "--shape", "1", "2", "64", "64", "64", "--out", "{file}/sub"], "cannot make the folder"),
    (["tune", "layernorm", "--shape", "32", "256", "--dtype", "float32", "--runner", "llvm", "--trials", "1",
      "--json", "{tmp}/no/such/dir/s.json", "--db", "{tmp}/t.db"], "--json .* no folder"),
    (["tune", "layernorm", "--shape", "32", "256", "--dtype", "float32", "--runner", "llvm", "--trials", "1",
      "--json", "{tmp}", "--db", "{tmp}/t.db"], "a folder is there, not a file"),
], ids=["build --out a file", "demo --out a file", "--out under a file", "--json without its folder", "--json a dir"])
def test_an_output_that_cannot_be_written_is_named_before_the_work(tmp_path, capsys, argv, match) -> None:
    """These raised a traceback after the compile or the tune."""
    (tmp_path / "f").write_text("not a folder")
    args = [a.format(file=tmp_path / "f", tmp=tmp_path) for a in argv]
    assert main(args) == 2
    import re

    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err, err
    assert not (tmp_path / "t.db").exists()  # refused before the tune began


def test_a_negative_seed_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "layernorm", "--shape", "32", "256", "--runner", "llvm", "--seed", "-1"])
    assert "--seed: -1 is less than 0" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["results garbage", "results {}", "manifest garbage", "a result of another batch"])
def test_an_offline_batch_that_cannot_be_imported_stores_nothing(tmp_path, capsys, damage) -> None:
    """A damaged results.json or manifest, or a result the manifest lacks: a clear error, and no record of the
    batch stored (the good ones before the bad one were, and a re-import then measured them twice)."""
    from search.database import TuningDatabase
    from search.records import MeasureResult
    from spacefusion.runners import MANIFEST_FORMAT

    g = patterns.layernorm(32, 256)
    s = schedule(g)
    folder = tmp_path / "batch"
    folder.mkdir()
    entry = {"schedule_key": s.key, "target": "cuda:sm_90a", "artefact": s.key, "workload": {}, "seed": 0,
             "schedule": s.to_dict()}
    (folder / "manifest.json").write_text(json.dumps({"format": MANIFEST_FORMAT, "candidates": [entry]}))
    good = MeasureResult(s.key, "cuda:sm_90a", (12.5,), 1e-4).to_dict()
    other = MeasureResult("f" * 64, "cuda:sm_90a", (9.0,), 1e-4).to_dict()
    (folder / "results.json").write_text(json.dumps([good, other]))
    if damage == "results garbage":
        (folder / "results.json").write_text("garbage")
    elif damage == "results {}":
        (folder / "results.json").write_text("{}")
    elif damage == "manifest garbage":
        (folder / "manifest.json").write_text("garbage")
    db = tmp_path / "t.db"
    argv = ["tune", "layernorm", "--shape", "32", "256", "--dtype", "float32", "--runner", "offline", "--batch-dir",
            str(tmp_path / "next"), "--import-results", str(folder), "--db", str(db), "--trials", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "Traceback" not in err, err
    if db.exists():
        with TuningDatabase(db, readonly=True) as d:
            assert sum(d.count(k) for k in d.workloads()) == 0


def test_a_tensor_beyond_32_bit_indices_is_refused_before_tvm(tmp_path, capsys) -> None:
    """A GEMM whose output has 2^32 elements raised TVM's int32 literal error from inside its passes; a
    LayerNorm over 2^40 rows wrote a kernel with a grid of 2^34 blocks."""
    from smg.errors import ShapeError
    from smg.workloads import gemm
    from spacefusion.lower.build import check_index_range

    with pytest.raises(ShapeError, match=r"space 'C' \(65536, 65536\) has 4294967296 elements.*32-bit"):
        check_index_range(schedule(gemm(65536, 65536, 16)))
    assert main(["build", "layernorm", "--shape", str(2**40), "64", "--dtype", "float32", "--out",
                 str(tmp_path / "o")]) == 2
    assert "has 70368744177664 elements" in capsys.readouterr().err
    assert not (tmp_path / "o" / "kernel.json").exists()


def test_the_help_lists_each_workloads_sizes_and_a_size_too_many_is_refused(capsys) -> None:
    """``--shape`` said nothing of its order, and ``attention --shape 1 2 64 64 64 2 1`` set ``causal`` from its
    seventh number without a word."""
    from spacefusion.cli import shapes_epilog

    text = shapes_epilog()
    assert "attention          batch heads seq_q seq_kv head_dim [kv_heads]" in text
    assert "gemm               m n k" in text
    assert main(["build", "attention", "--shape", "1", "2", "64", "64", "64", "2", "1", "--out", "x"]) == 2
    assert "takes at most 6 sizes (batch heads seq_q seq_kv head_dim kv_heads); got 7" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert "(default: 64)" in out and "softmax_gemm       m l n" in out
