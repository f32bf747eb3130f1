"""A kernel cache remembers the models and graphs it compiled (``frontend.seen``), so a warm compile does not
start the export workers whose imports would only slow it, and a graph it has not seen still does."""

from __future__ import annotations

import pytest
import torch

from spacefusion.frontend.backends import CudaBackend
from spacefusion.frontend.dynamo import SpaceFusionBackend
from spacefusion.frontend.parallel_build import WORKERS_ENV
from spacefusion.frontend.schedules import default_schedule
from spacefusion.frontend.seen import SEEN_DIR, graph_signature, mark, model_signature, seen

pytest.importorskip("tvm")


def _block(hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden)).eval()


def _graphs(model: torch.nn.Module, x: torch.Tensor) -> list:
    got = []

    def record(gm, example_inputs):
        got.append(graph_signature(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=record, dynamic=False)(x)
    return got


def test_signatures_name_what_was_compiled_not_the_objects() -> None:
    assert model_signature(_block()) == model_signature(_block())  # another instance of the same model
    assert model_signature(_block()) != model_signature(_block(32))
    assert model_signature(_block()) != model_signature(_block().half())
    x = torch.randn(4, 64)
    assert _graphs(_block(), x) == _graphs(_block(), x)  # a new trace of the same graph
    assert _graphs(_block(), x) != _graphs(_block(), torch.randn(8, 64))  # other sizes
    assert _graphs(_block(), x) != _graphs(_block().double(), x.double())


def test_an_unwritable_cache_is_left_as_it_is(tmp_path) -> None:
    (tmp_path / SEEN_DIR).write_text("a file where the folder would be")
    mark(tmp_path, ["graph-x"])  # no error: the mark only saves time
    assert not seen(tmp_path, "graph-x")


def test_a_warm_compile_starts_no_export_workers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compile of a graph starts the workers and marks it; a new process's compile of the same graph
    over the same cache (a new backend after a Dynamo reset) starts none; other sizes start them again."""
    monkeypatch.setenv(WORKERS_ENV, "1")  # the exports in this process: what is tested is the start
    starts: list[int] = []
    monkeypatch.setattr("spacefusion.frontend.parallel_build.start_pool", lambda *a: starts.append(1) or 0)
    with torch.device("meta"):
        model = _block().half()

    def compile_once(rows: int) -> SpaceFusionBackend:
        torch._dynamo.reset()
        backend = SpaceFusionBackend(CudaBackend(tmp_path, schedule_for=default_schedule, build_missing=True,
                                                 load=False), export_only=True)
        with torch.no_grad():
            torch.compile(model, backend=backend, dynamic=False)(torch.zeros(rows, 64, dtype=torch.half,
                                                                               device="meta"))
        assert backend.graphs and backend.graphs[0].partition.subgraphs, str(backend)
        return backend

    compile_once(16)
    assert starts == [1] and len(list((tmp_path / SEEN_DIR).iterdir())) == 1
    compile_once(16)
    assert starts == [1]
    compile_once(32)
    assert starts == [1, 1] and len(list((tmp_path / SEEN_DIR).iterdir())) == 2


def test_an_unwritable_kernel_cache_is_named_before_any_work(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spacefusion.frontend.dynamo import writable_kernel_cache
    from spacefusion.frontend.errors import FrontendError

    blocked = tmp_path / "home"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(blocked / "sf"))
    with pytest.raises(FrontendError, match="cannot be written.*SPACEFUSION_CACHE"):
        writable_kernel_cache()
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path / "sf"))
    assert writable_kernel_cache() == tmp_path / "sf" / "kernels" and not list((tmp_path / "sf" / "kernels").iterdir())
