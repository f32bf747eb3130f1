"""The search's layout decision for a convolution of an NCHW image (``spacefusion.frontend.layouts``): read it
where it lies, or copy it channels-last first, priced by the cost model; recorded beside an export's kernels
(``layouts.json``) for the GPU machine, which has no cost model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from schedulers.hardware import H100, H200
from smg import patterns
from smg.reference import evaluate, random_inputs
from spacefusion.frontend.backends import CudaBackend, LLVMBackend
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import fuse
from spacefusion.frontend.layouts import LAYOUT_RULE, LayoutChoice, choose_layout, copy_of

RESULTS = "experiments/results/conv_chains_nchw_h200.json"


def _conv(layout: str, n: int = 2, h: int = 6, w: int = 6, c: int = 16, co: int = 8, k: int = 1, stride: int = 1,
          dtype: str = "float32"):
    return patterns.conv2d(n, h, w, c, co, k, stride, k // 2, act="relu", dtype=dtype, layout=layout)


def test_the_copy_is_the_transpose() -> None:
    smg = copy_of(_conv("nchw", h=5, w=3))
    ins = random_inputs(smg, seed=0)
    assert smg.space("X").dims == ("n", "c", "s") and smg.space("Y").dims == ("n", "s", "c")
    np.testing.assert_array_equal(evaluate(smg, ins)["Y"], ins["X"].transpose(0, 2, 1))


def _measured(key: str) -> tuple[float, float]:
    """The committed H200 run's best measured time of each path for chain ``key``: (read NCHW, copy + NHWC)."""
    with open(RESULTS) as f:
        chains = {e["chain"]["key"]: e for e in json.load(f)["chains"]}

    def best(entry: dict, system: str = "spacefusion") -> float:
        return min(r["median_us"] for r in entry["rows"] if r["system"] == system and r["status"] == "ok")

    nchw = chains[key + "_nchw"]
    return best(nchw), best(nchw, "transpose_to_nhwc") + best(chains[key])


@pytest.mark.parametrize("key, shape", [("r50_l1_1x1_in", (32, 56, 56, 256, 64, 1, 1)),
                                        ("r50_l1_3x3", (32, 56, 56, 64, 64, 3, 1))])
def test_the_model_decides_as_the_h200_measured(key: str, shape: tuple[int, ...]) -> None:
    """ResNet-50's layer1 at batch 32: the 1x1 read NCHW measured 25.8 us against 151.9 + 20.5 copied first,
    the 3x3 113.4 against 34.6 + 23.7 (``RESULTS``); the model's decision is the faster path of each."""
    n, h, w, c, co, k, s = shape
    choice = choose_layout(*(_conv(lay, n, h, w, c, co, k, s, "float16") for lay in ("nchw", "nhwc")), H200)
    nchw_us, copied_us = _measured(key)
    assert choice.layout == ("nchw" if nchw_us < copied_us else "nhwc"), (choice.reason, nchw_us, copied_us)
    assert choice.hardware == "H200" and choice.copy_us > 0 and choice.nhwc_us > 0


def test_a_choice_round_trips_and_refuses_another_rule() -> None:
    c = LayoutChoice("nchw", 45.5, 15.4, 153.5, "H200")
    assert LayoutChoice.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="rule"):
        LayoutChoice.from_dict({**c.to_dict(), "rule": LAYOUT_RULE - 1})
    with pytest.raises(ValueError, match="damaged"):
        LayoutChoice.from_dict({"rule": LAYOUT_RULE, "layout": "nchw"})
    with pytest.raises(ValueError, match="unknown image layout 'nwhc'"):
        LayoutChoice("nwhc", 1.0, 1.0, 1.0, "H100")


class _Head(torch.nn.Module):
    """A 1x1 and a 3x3 conv of the model's NCHW input (a ResNet stage's shortcut and main branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.one, self.three = torch.nn.Conv2d(16, 8, 1), torch.nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.one(x)) + torch.relu(self.three(x))


def _decided(calls: list[str], layout: str):
    def layout_of(nchw, nhwc) -> LayoutChoice:
        calls.append(nchw.key)
        return LayoutChoice(layout, 1.0, 2.0, 3.0, "test")

    return layout_of


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_the_partition_follows_the_backends_decision_and_says_why(layout: str) -> None:
    """Each conv of the NCHW input asks the backend (once per conv); the choice sets its SMG, its label and
    the report's line, and the outputs match eager either way.  A channels-last input asks nothing."""
    torch.manual_seed(0)
    model, x = _Head().eval(), torch.randn(2, 16, 6, 5)
    calls: list[str] = []
    backend = LLVMBackend()
    backend.layout_of = _decided(calls, layout)  # type: ignore[method-assign]
    with torch.no_grad():
        fused = fuse(model, x, backend=backend)
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(calls) == 2
    labels = sorted(s.label for s in fused.partition.subgraphs)
    assert all(("(NCHW image)" in lb) == (layout == "nchw") for lb in labels), labels
    text = str(fused.partition)
    want = "read NCHW where it lies" if layout == "nchw" else "copied channels-last first"
    assert text.count(f"image {want}") == 2, text
    calls.clear()
    with torch.no_grad():
        fuse(model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last),
                         backend=backend)
    assert calls == []


def test_an_export_records_the_layouts_and_the_gpu_side_reads_them(tmp_path, monkeypatch) -> None:
    """``CudaBackend.layout_of`` decides once and writes ``layouts.json``; a backend on the same folder (the
    GPU machine's, without the cost model) reads the decision back instead of deciding; another rule's record
    is decided again; a file that is not a record raises, naming it, and is left as it was."""
    import spacefusion.frontend.layouts as layouts

    nchw, nhwc = _conv("nchw"), _conv("nhwc")
    got = CudaBackend(tmp_path, load=False).layout_of(nchw, nhwc)
    record = json.loads((tmp_path / "layouts.json").read_text())
    assert record == {nchw.key[:16]: got.to_dict()} and got.hardware == H100.name

    def no_model(*a, **k):
        raise ImportError("no islpy here")

    monkeypatch.setattr(layouts, "choose_layout", no_model)
    assert CudaBackend(tmp_path, load=False).layout_of(nchw, nhwc) == got
    fallback = LLVMBackend().layout_of(nchw, nhwc)  # nothing recorded, no model: channels-last, said so
    assert fallback.layout == "nhwc" and math.isnan(fallback.nchw_us) and "no cost model" in fallback.reason

    old = {nchw.key[:16]: {**got.to_dict(), "layout": "nhwc" if got.layout == "nchw" else "nchw", "rule": 0}}
    (tmp_path / "layouts.json").write_text(json.dumps(old))
    monkeypatch.undo()
    assert CudaBackend(tmp_path, load=False).layout_of(nchw, nhwc) == got
    assert json.loads((tmp_path / "layouts.json").read_text())[nchw.key[:16]]["rule"] == LAYOUT_RULE

    (tmp_path / "layouts.json").write_text("[1, 2]")
    with pytest.raises(FrontendError, match="layouts.json is not a layouts record"):
        CudaBackend(tmp_path, load=False).layout_of(nchw, nhwc)
    assert (tmp_path / "layouts.json").read_text() == "[1, 2]"


class _RgbStem(torch.nn.Module):
    """An RGB stem left to torch (a 3x1 kernel: the implicit GEMM takes square ones; a square RGB stem is fused
    since issue 56) read by a fused conv, in torch's default NCHW memory."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, (3, 1), padding=(1, 0))
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(self.stem(x)))


def test_a_stem_left_to_torch_runs_channels_last_when_fused_kernels_read_it_so() -> None:
    """The stem's NCHW image is copied channels-last before it, so torch's conv answers channels-last and the
    fused conv's binding reads that as it lies; the partition says so, the output still equals eager, and a
    channels-last model is left as it is."""
    from spacefusion.frontend.left_convs import CHANNELS_LAST

    torch.manual_seed(0)
    model, x = _RgbStem().eval(), torch.randn(2, 3, 8, 6)
    seen: dict[str, bool] = {}

    class Watch(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_module" and isinstance(self.module.get_submodule(n.target), torch.nn.Conv2d):
                seen[n.name] = out.is_contiguous(memory_format=torch.channels_last)
            return out

    for channels_last in (False, True):
        m, xx = (model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)) \
            if channels_last else (model, x)
        with torch.no_grad():
            fused = fuse(m, xx, backend="llvm")
            torch.testing.assert_close(fused(xx), model(x), rtol=1e-4, atol=1e-4)
            seen.clear()
            Watch(fused.graph_module).run(xx)
        stem = [op for op in fused.partition.left if "square kernels" in op.reason]
        assert len(stem) == 1 and (CHANNELS_LAST in stem[0].reason) == (not channels_last), stem
        assert list(seen.values()) == [True], seen  # torch's stem conv answers channels-last either way
