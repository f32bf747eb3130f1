"""Tuning orchestration: distinct subgraphs tuned once, one database shared across models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from search.database import TuningDatabase
from smg import patterns
from spacefusion.frontend import LLVMBackend, capture, fuse, partition
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.schedules import default_schedule, from_database
from spacefusion.frontend.tune import tune_partitions
from spacefusion.runners import LLVMRunner


class _Block(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(16, 16) for _ in range(n_layers))
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return self.norm(x)


def test_tune_shares_the_database_across_subgraphs_and_models(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    a, b = _Block(3).eval(), _Block(1).eval()
    pa, pb = (partition(capture(m, x).module) for m in (a, b))
    db = tmp_path / "tuning.db"
    runner = LLVMRunner(repeats=1, warmup=0)
    asked = []

    def per_smg(smg):  # a runner per subgraph (an offline batch folder each, on the GPU flow)
        asked.append(smg.key)
        return runner

    first = tune_partitions(pa, per_smg, db, target="llvm", trials=2, batch=2)
    assert [t.uses for t in first.tuned] == [3, 1]  # three identical GEMM + ReLU layers: tuned once
    assert asked == list(pa.distinct)
    assert first.cached == 0 and all(t.summary.best is not None for t in first.tuned)
    assert "total tuning time" in capsys.readouterr().out
    second = tune_partitions(pb, runner, db, target="llvm", trials=2, batch=2)
    assert second.cached == len(second.tuned) == 2  # model b's subgraphs are model a's: nothing measured
    fused = fuse(a, x, backend=LLVMBackend(first.schedule_for()))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), a(x), rtol=1e-4, atol=1e-4)
    with TuningDatabase(db) as opened:  # the same bests, read back from the file
        pick = from_database(opened, target="llvm")
        for t in first.tuned:
            assert pick(t.summary.best.smg).key == t.summary.best.key
        other = patterns.softmax(4, 8)
        assert pick(other).key == default_schedule(other).key


def test_captured_partitions_keep_the_kinds_asked_for() -> None:
    """``captured_partitions(..., kinds=["conv"])``: a model's convolutions alone, to tune them apart."""
    from spacefusion.frontend.tune import captured_partitions

    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(1), nn.Linear(8 * 4 * 4, 8)).eval()
    x = torch.randn(2, 8, 4, 4)
    every = [s.kind for p in captured_partitions(model, x) for s in p.subgraphs]
    torch._dynamo.reset()
    convs = [s.kind for p in captured_partitions(model, x, kinds=["conv"]) for s in p.subgraphs]
    torch._dynamo.reset()
    assert sorted(every) == ["conv", "gemm"] and convs == ["conv"], (every, convs)
    with pytest.raises(FrontendError, match="no subgraph of kind convs in Sequential; its kinds: conv, gemm"):
        captured_partitions(model, x, kinds=["convs"])
    torch._dynamo.reset()


def _two_machine_db(tmp_path):
    """A database with a softmax SMG measured on an H100 and an H200 (a different schedule each, neither the
    first pick) and another measured on the H100 only; (path, both, h100_only, neither, picks)."""
    from schedulers.hardware import H100, H200
    from search.database import key_parts, tuning_key
    from search.records import MeasureResult
    from spacefusion.frontend.schedules import ranked
    from spacefusion.lower.build import COMPILE_FLAGS

    both, h100_only, neither = patterns.softmax(64, 256), patterns.softmax(32, 512), patterns.softmax(16, 128)
    target = "cuda:sm_90a"
    db = tmp_path / "t.db"
    picks = {}
    with TuningDatabase(db) as opened:
        for smg, machines in ((both, (H100, H200)), (h100_only, (H100,))):
            order = ranked(smg)
            for i, hw in enumerate(machines):
                s = order[i + 1]
                picks[(smg.key, hw.name)] = s.key
                res = MeasureResult(schedule_key=s.key, target=target, latencies_us=(10.0,), max_abs_err=0.0)
                key = tuning_key(smg, hw, target, COMPILE_FLAGS)
                opened.add(key, s, res, key_parts(smg, hw, target, COMPILE_FLAGS))
    return db, both, h100_only, neither, picks


def test_tuned_reads_the_named_machines_records_in_order(tmp_path) -> None:
    """Records are keyed by the machine they were measured on: ``tuned(..., ("H200", "H100"))`` takes an
    H200 record where there is one, else the H100's, else the fallback; an unknown machine is named."""
    from spacefusion.frontend.dynamo import tuned
    from spacefusion.frontend.schedules import ranked

    db, both, h100_only, neither, picks = _two_machine_db(tmp_path)
    target = "cuda:sm_90a"
    fallback = lambda smg: ranked(smg)[0]  # noqa: E731
    h200_first = tuned(db, target, fallback, ("H200", "H100"))
    assert h200_first(both).key == picks[(both.key, "H200")]
    assert h200_first(h100_only).key == picks[(h100_only.key, "H100")]
    assert h200_first(neither).key == ranked(neither)[0].key
    assert tuned(db, target, fallback)(both).key == picks[(both.key, "H100")]  # the default: H100's alone
    with pytest.raises(FrontendError, match="unknown hardware 'Z9'"):
        tuned(db, target, fallback, ("Z9",))


@pytest.mark.parametrize("name, preset", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
                                          ("NVIDIA H100 PCIe", "H100"), ("Some GPU 9000", "H100")])
def test_the_cuda_target_reads_this_gpus_records_first(tmp_path, monkeypatch, name: str, preset: str) -> None:
    """``spacefusion.compile(model, target="cuda", db=...)``: each SMG's best record of this GPU's preset
    (``device_hardware``; an unknown name is taken for an H100), else the H100's, else the first pick."""
    from spacefusion.frontend import dynamo

    db, both, h100_only, _, picks = _two_machine_db(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path / "cache"))
    assert dynamo.device_hardware().name == preset
    pick = dynamo.kernel_backend("cuda", db).schedule_for
    assert pick(both).key == picks[(both.key, preset)]
    assert pick(h100_only).key == picks[(h100_only.key, "H100")]
