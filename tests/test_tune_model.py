"""Tune a model's fused SMGs into a database, then compile it from that database (frontend.tune.tune_model,
``spacefusion.compile(model, db=...)``), on the CPU runner; and the bad inputs of that flow."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import spacefusion  # noqa: E402
from search.database import TuningDatabase, tuning_key  # noqa: E402
from spacefusion.frontend import FrontendError  # noqa: E402
from spacefusion.frontend.tune import tune_model  # noqa: E402
from spacefusion.lower.build import COMPILE_FLAGS  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln = torch.nn.Linear(64, 128), torch.nn.LayerNorm(128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(torch.nn.functional.gelu(self.fc(x)))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_a_model_tuned_on_the_cpu_compiles_from_its_database(tmp_path) -> None:
    """Every distinct SMG gets measured candidates; the compiled model builds each SMG's best from the
    database (not the default schedule) and matches eager; tuning again costs nothing but the capture."""
    torch.manual_seed(0)
    model, x, db = _Block().eval(), torch.randn(32, 64), tmp_path / "tuning.db"
    report = tune_model(model, x, db=db, runner="llvm", trials=3, progress=False)
    assert len(report.tuned) == 2 and all(t.summary.best is not None for t in report.tuned), str(report)
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target="llvm", db=db)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    backend = compiled.spacefusion
    subs = [s for p in backend.partitions for s in p.subgraphs]
    assert len(subs) == 2
    with TuningDatabase(db, readonly=True) as opened:
        for sub in subs:
            best = opened.best(tuning_key(sub.smg, "h100", "llvm", COMPILE_FLAGS))
            assert best is not None and backend.kernels.schedule_for(sub.smg).key == best[0].key
    torch._dynamo.reset()
    again = tune_model(model, x, db=db, runner="llvm", trials=3, progress=False)
    assert again.cached == 2


def test_tuning_and_database_errors_name_the_problem(tmp_path) -> None:
    model, x = _Block().eval(), torch.randn(4, 64)
    with pytest.raises(FrontendError, match="unknown tuning runner 'tpu'"):
        tune_model(model, x, db=tmp_path / "a.db", runner="tpu")
    with pytest.raises(FrontendError, match="trials must be at least 1, got 0"):
        tune_model(model, x, db=tmp_path / "a.db", runner="llvm", trials=0)
    if not torch.cuda.is_available():
        with pytest.raises(FrontendError, match="runner 'gpu' needs a CUDA GPU"):
            tune_model(model, x, db=tmp_path / "a.db", runner="gpu")
    with pytest.raises(FrontendError, match="no tuning database at"):
        spacefusion.compile(model, target="llvm", db=tmp_path / "missing.db")
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not a database at all" * 10)
    with pytest.raises(FrontendError, match="tuning database .*corrupt.db"):
        spacefusion.compile(model, target="llvm", db=corrupt)
    assert corrupt.read_bytes() == b"not a database at all" * 10  # nothing that was there is lost
    with pytest.raises(FrontendError, match="applies to the 'llvm' and 'cuda' targets"):
        spacefusion.compile(model, target="reference", db=corrupt)
