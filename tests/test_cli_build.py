"""``spacefusion build``: the tensor-core knobs and ``--schedule`` from the command line, and the
errors a mistyped command gets (exit 2 with the problem named, no traceback)."""

from __future__ import annotations

from smg import patterns
from spacefusion.api import schedule
from spacefusion.cli import main

ATT = ["attention", "--shape", "1", "2", "100", "100", "64", "--tile-m", "32", "--target", "cuda"]


def test_build_takes_the_tensor_core_knobs(tmp_path, capsys) -> None:
    assert main(["build", *ATT, "--tensor-cores", "--stages", "2", "--early-scores", "--lazy-rescale",
                 "--out", str(tmp_path / "a")]) == 0
    src = (tmp_path / "a" / "kernel.cu").read_text()
    assert "mma.sync.aligned.m16n8k16" in src and "__any_sync" in src and "wait_group_1();" in src
    out = capsys.readouterr().out
    assert "tensor cores: 2 warps x 1 16-row mma tile, 2-stage cp.async ring" in out and "P_max kept within" in out


def test_build_takes_the_producer_knobs(tmp_path, capsys) -> None:
    gemm = ["gemm_epilogue", "--shape", "512", "512", "256", "--tile-m", "64", "--tile-n", "256", "--step", "64",
            "--target", "cuda", "--tensor-cores", "--stages", "4", "--wgmma", "--tma"]
    assert main(["build", *gemm, "--producer", "--persistent", "5", "--pingpong", "--fast-math",
                 "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "persistent: 5 blocks" in out and "pingpong" in out and "tanh.approx.f32" in out
    assert "grid [5, 1, 1], block [384, 1, 1]" in out
    assert main(["build", *gemm, "--pingpong", "--out", str(tmp_path / "x")]) == 2
    assert "pingpong gives a persistent block" in capsys.readouterr().err


def test_build_from_a_schedule_file_matches_the_knobs(tmp_path) -> None:
    s = schedule(patterns.attention(1, 2, 100, 100, 64), tiles={"m": 32}, step=32, tensor_cores=True, stages=2,
                 lazy_rescale=True)
    (tmp_path / "s.json").write_text(s.to_json())
    assert main(["build", "--schedule", str(tmp_path / "s.json"), "--target", "cuda",
                 "--out", str(tmp_path / "f")]) == 0
    assert main(["build", *ATT, "--tensor-cores", "--stages", "2", "--lazy-rescale", "--out", str(tmp_path / "k")]) == 0
    assert (tmp_path / "f" / "kernel.cu").read_text() == (tmp_path / "k" / "kernel.cu").read_text()


def test_build_errors_name_the_problem(tmp_path, capsys) -> None:
    assert main(["build", *ATT, "--stages", "2", "--out", str(tmp_path / "x")]) == 2
    assert "apply to tensor-core warp-tile kernels (tensor_cores=True)" in capsys.readouterr().err
    assert main(["build", "--out", str(tmp_path / "x")]) == 2
    assert "needs a workload and --shape, or --schedule FILE" in capsys.readouterr().err
    assert main(["build", "--schedule", str(tmp_path / "none.json"), "--out", str(tmp_path / "x")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["build", "--schedule", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["build", "gemm_epilogue", "--shape", "64", "64", "64", "--tile-m", "64", "--tile-n", "64",
                 "--serial", "k", "--tensor-cores", "--stages", "2", "--lazy-rescale", "--target", "cuda",
                 "--out", str(tmp_path / "x")]) == 2
    assert "lazy_rescale keeps a running max" in capsys.readouterr().err
