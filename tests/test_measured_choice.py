"""The measured choice of a compiled graph (``frontend.measure``): after a build, calls alternate between the fused
path and torch's graph, each running exactly one of them, until the faster median is kept.  Every test injects
the timer (``SpaceFusionBackend.timer``), so what is kept is decided by the numbers the test gives, never by this
machine's clock; the outputs, a buffer the graph writes and a training step's gradients are compared with eager
on every call, the measuring ones included."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from spacefusion.frontend import measure
from spacefusion.frontend.dynamo import SpaceFusionBackend, dynamo_backend
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import FusedKernel
from spacefusion.frontend.measure import FUSED, TORCH, Choice

#: calls until the choice is made: each path's warm-up and samples
DECIDED_AFTER = 2 * (measure.WARMUP + measure.SAMPLES)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class FakeTimer:
    """A timer giving each path the seconds the test chose; records the path of every call it timed."""

    def __init__(self, fused: float, torch_: float) -> None:
        self.seconds = {FUSED: fused, TORCH: torch_}
        self.paths: list[str] = []

    def __call__(self, path: str, call: Callable[[], Any], cuda: bool) -> tuple[Any, float]:
        self.paths.append(path)
        return call(), self.seconds[path]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the fused kernels' calls (one entry per kernel call): whether a call ran the fused path."""
    calls: list[int] = []
    forward = FusedKernel.forward

    def counting(self: FusedKernel, *args: torch.Tensor) -> Any:
        calls.append(1)
        return forward(self, *args)

    monkeypatch.setattr(FusedKernel, "forward", counting)
    return calls


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Counting(MLP):
    """An MLP with a step counter written in forward: state the graph writes, once per call in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return super().forward(x) + self.steps.float()


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + i))


def _run(model: nn.Module, backend: SpaceFusionBackend, calls: int,
         kernel_calls: list[int] | None = None) -> list[bool]:
    """``calls`` inference calls of ``model`` compiled with ``backend``, each checked against eager on a copy;
    returns, per call, whether fused kernels ran in it."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    ran: list[bool] = []
    with torch.no_grad():
        for i in range(calls):
            before = len(kernel_calls) if kernel_calls is not None else 0
            torch.testing.assert_close(compiled(_x(i)), eager(_x(i)), rtol=1e-5, atol=1e-5)
            ran.append(kernel_calls is not None and len(kernel_calls) > before)
    return ran


def _alternation(n: int) -> list[str]:
    return [FUSED if i % 2 == 0 else TORCH for i in range(n)]


def test_fused_slower_keeps_torch_and_every_call_matches_eager(kernel_calls: list[int]) -> None:
    timer = FakeTimer(fused=2e-3, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    ran = _run(MLP(), backend, DECIDED_AFTER + 3, kernel_calls)
    (graph,) = backend.graphs
    assert graph.partition is not None and graph.partition.subgraphs, str(backend)
    assert timer.paths == _alternation(DECIDED_AFTER)  # timed while measuring only; then torch, untimed
    assert ran == [p == FUSED for p in timer.paths] + [False] * 3  # each call ran one path: kernels on fused ones
    assert graph.kept == "kept.torch" and graph.fused_s == 2e-3 and graph.torch_s == 1e-3
    assert "[kept.torch]: fused 2.000 ms, torch 1.000 ms" in str(backend)


def test_fused_faster_keeps_fused(kernel_calls: list[int]) -> None:
    timer = FakeTimer(fused=1e-3, torch_=2e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    ran = _run(MLP(), backend, DECIDED_AFTER + 3, kernel_calls)
    assert timer.paths == _alternation(DECIDED_AFTER)
    assert ran == [p == FUSED for p in timer.paths] + [True] * 3
    assert backend.graphs[0].kept == "kept.fused"
    assert "[kept.fused]: fused 1.000 ms, torch 2.000 ms" in str(backend)


@pytest.mark.parametrize("ratio,kept", [(1.0, "kept.fused"), (1 + measure.MARGIN / 2, "kept.fused"),
                                        (1 + 2 * measure.MARGIN, "kept.torch")])
def test_a_fused_path_within_the_margin_is_kept(ratio: float, kept: str) -> None:
    backend = SpaceFusionBackend("reference", measure=True, timer=FakeTimer(fused=ratio * 1e-3, torch_=1e-3))
    _run(MLP(), backend, DECIDED_AFTER)
    assert backend.graphs[0].kept == kept


def test_a_buffer_written_in_forward_is_written_once_per_call() -> None:
    model = Counting()
    backend = SpaceFusionBackend("reference", measure=True, timer=FakeTimer(fused=2e-3, torch_=1e-3))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i in range(DECIDED_AFTER + 3):
            torch.testing.assert_close(compiled(_x(i)), eager(_x(i)), rtol=1e-5, atol=1e-5)
            assert int(model.steps) == int(eager.steps) == i + 1, (i, int(model.steps))
    assert backend.graphs[0].partition.subgraphs and backend.graphs[0].kept == "kept.torch", str(backend)


def test_a_rebuild_starts_a_new_measurement() -> None:
    timer = FakeTimer(fused=2e-3, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    model = MLP()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i in range(4):
            torch.testing.assert_close(compiled(_x(i)), eager(_x(i)), rtol=1e-5, atol=1e-5)
        for m in (model, eager):  # new weights: the next fused call builds again
            m.fc1.weight.mul_(0.5)
        for i in range(4, 5 + DECIDED_AFTER):
            torch.testing.assert_close(compiled(_x(i)), eager(_x(i)), rtol=1e-5, atol=1e-5)
    graph = backend.graphs[0]
    assert graph.rebuilds == 1, str(backend)
    # the call that rebuilt (fused, the 5th) is no sample: the new build's measurement starts after it
    assert timer.paths == _alternation(4) + [FUSED] + _alternation(DECIDED_AFTER)
    assert graph.kept == "kept.torch"


def test_coverage_counts_a_kept_torch_graph_as_torch_s_and_the_partition_keeps_its_own() -> None:
    backend = SpaceFusionBackend("reference", measure=True, timer=FakeTimer(fused=2e-3, torch_=1e-3))
    _run(MLP(), backend, DECIDED_AFTER)
    (part,) = backend.partitions
    assert len(part.coverage().fused) == 2  # the partition's own count: both linears fused
    cov = backend.coverage()
    assert cov.fused == () and len(cov.left) == 2 and {op.code for op in cov.left} == {"kept.torch"}
    assert cov.fraction == 0.0


def test_measure_off_runs_the_kernels_on_every_call_untimed(kernel_calls: list[int]) -> None:
    timer = FakeTimer(fused=2e-3, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=False, timer=timer)
    ran = _run(MLP(), backend, DECIDED_AFTER + 1, kernel_calls)
    assert ran == [True] * (DECIDED_AFTER + 1) and timer.paths == []
    assert backend.graphs[0].kept is None and "measur" not in str(backend)
    assert len(backend.coverage().fused) == 2


def test_the_defaults_measure_on_cuda_only() -> None:
    assert not SpaceFusionBackend("reference").measuring and not SpaceFusionBackend("llvm").measuring
    assert SpaceFusionBackend("reference", measure=True).measuring


def test_bad_options_are_refused_naming_them() -> None:
    with pytest.raises(FrontendError, match="measure must be True, False or None"):
        SpaceFusionBackend("reference", measure="yes")  # type: ignore[arg-type]
    with pytest.raises(FrontendError, match="timer must be callable"):
        SpaceFusionBackend("reference", timer=3)  # type: ignore[arg-type]
    with pytest.raises(FrontendError, match="known: target, verbose, db, measure"):
        dynamo_backend(torch.fx.symbolic_trace(MLP()), [_x(0)], options={"measured": True})


def test_torch_compile_options_pass_measure() -> None:
    compiled = torch.compile(MLP(), backend="spacefusion", options={"target": "reference", "measure": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x(0)), MLP()(_x(0)), rtol=1e-5, atol=1e-5)


def test_choice_decides_on_medians_after_warm_up() -> None:
    c = Choice(timer=None)
    times = {FUSED: [9.0, 1.0, 5.0, 1.2], TORCH: [9.0, 1.1, 1.1, 1.1]}  # fused median 1.2 > 1.1 * 1.03
    for i in range(DECIDED_AFTER):
        path = c.next_path()
        assert path == _alternation(DECIDED_AFTER)[i]
        decided = c.record(path, times[path].pop(0))
        assert decided == (i == DECIDED_AFTER - 1)
    assert c.kept == TORCH and c.medians == {FUSED: 1.2, TORCH: 1.1} and c.next_path() == TORCH
    assert not c.record(FUSED, 0.1) and c.kept == TORCH  # decided for good
    with pytest.raises(ValueError, match="unknown path"):
        Choice().record("inductor", 1.0)
    with pytest.raises(ValueError, match="a timer returns a time >= 0"):
        Choice().record(FUSED, -1.0)
    assert Choice(on=False).next_path() == FUSED and not Choice(on=False).measuring


def test_wall_timer_returns_the_call_s_result() -> None:
    out, seconds = measure.wall_timer(FUSED, lambda: 42, cuda=False)
    assert out == 42 and seconds >= 0.0


class TrainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def _steps(model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], steps: int) -> list[tuple]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        opt.zero_grad()
        loss = run(_x(i))
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


@pytest.mark.parametrize("fused,kept", [(2e-3, "kept.torch"), (0.5e-3, "kept.fused")])
def test_training_stages_measure_and_keep_eager_s_gradients(fused: float, kept: str,
                                                            kernel_calls: list[int]) -> None:
    model, eager = TrainMLP(), TrainMLP()
    timer = FakeTimer(fused=fused, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    steps = DECIDED_AFTER + 2
    got = _steps(model, torch.compile(model, backend=backend), steps)
    want = _steps(eager, eager, steps)
    for (gl, gg), (wl, wg) in zip(got, want, strict=True):
        torch.testing.assert_close(gl, wl, rtol=1e-5, atol=1e-6)
        for name, w in wg.items():
            torch.testing.assert_close(gg[name], w, rtol=1e-4, atol=1e-6)
    (graph,) = backend.graphs
    assert graph.forward.partition.subgraphs and graph.backward.partition.subgraphs, str(backend)
    assert graph.forward.kept == graph.backward.kept == kept, str(backend)
    # forward and backward alternate apart: each stage's calls, one per step, interleaved in the timer's list
    assert timer.paths[:2 * DECIDED_AFTER] == [p for p in _alternation(DECIDED_AFTER) for _ in (0, 1)]
    assert timer.paths[2 * DECIDED_AFTER:] == []
    text = str(backend)
    assert text.count(f"[{kept}]") == 2, text
    if kept == "kept.torch":
        assert backend.coverage().fused == () and len(backend.coverage().left) >= 2


def test_each_set_of_sizes_of_a_symbolic_graph_measures_apart() -> None:
    timer = FakeTimer(fused=2e-3, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    model = MLP()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for i in range(2 * DECIDED_AFTER + 2):
            x = torch.randn(4 if i % 2 == 0 else 6, 16, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (graph,) = backend.graphs
    assert len(graph.shapes) == 2 and all(r.kept == "kept.torch" for r in graph.shapes.values()), str(backend)
    # the two sizes' calls interleave, each size alternating on its own
    assert timer.paths == [p for p in _alternation(DECIDED_AFTER) for _ in (0, 1)]
    assert str(backend).count("[kept.torch]") == 2
    assert backend.coverage().fused == () and len(backend.coverage().left) == 4


def test_a_graph_with_nothing_fused_is_torch_s_and_not_measured() -> None:
    class Sines(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * 2

    timer = FakeTimer(fused=2e-3, torch_=1e-3)
    backend = SpaceFusionBackend("reference", measure=True, timer=timer)
    _run(Sines(), backend, DECIDED_AFTER)
    (graph,) = backend.graphs
    assert graph.partition is not None and not graph.partition.subgraphs, str(backend)
    assert timer.paths == [] and graph.kept is None and "measur" not in str(backend)
