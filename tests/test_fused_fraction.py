"""Issue 56: the fused fraction of each model's matmuls and convolutions (``Partition.coverage``), measured on
the tiny configs of ``experiments/fused_fraction.py`` (real ``transformers`` classes, seeded weights), each
checked against eager; a floor per model so a fraction cannot fall silently; DeBERTa-v2's heads-folded ``bmm``
attention (``alibi.match_bmm_attention``) and EfficientNet's string paddings on both CPU targets; and the
codes of what is left (none: DeBERTa's c2p / p2c ``bmm`` fused since the value-GEMM row, ``frontend.value_gemm``;
Mixtral's experts since indexed loads, ``frontend.experts``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import fused_fraction as ff  # noqa: E402

from spacefusion.frontend.records import Coverage, LeftOp, Partition  # noqa: E402

#: the fraction each model reached (fused / run per call): a model may only go up
FLOOR = {
    "deberta_v2": 1.0,  # its c2p / p2c bmm of Q (K) against the position projections too: the value_gemm row
    "falcon": 1.0, "falcon_40b": 1.0, "falcon_rw": 1.0, "bloom": 1.0, "mpt": 1.0,
    "mixtral": 1.0,  # the experts' grouped GEMMs too: the weight an indexed load along its expert dim (CPU)
    "convnext": 1.0,  # its 4x4/4 patchify stem: the patch GEMM (K = 48)
    "mobilenet_v2": 1.0,  # the RGB stem too since issue 56 (K = 27 padded to 32: convs.k_align)
    "efficientnet": 1.0,  # likewise
}
#: what each model may leave, by code: anything else left is a regression of the report too
LEFT_CODES: dict[str, set[str]] = {}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_every_model_of_the_script_has_a_floor() -> None:
    assert set(FLOOR) == set(ff.MODELS)


@pytest.mark.parametrize("name", sorted(FLOOR))
def test_fused_fraction_is_at_least_what_was_reached(name: str) -> None:
    m, _ = ff.measure(name, "reference")
    assert not m.skipped and m.total > 0, m
    assert m.fraction >= FLOOR[name] - 1e-9, (
        f"{name}: {m.fused}/{m.total} fused, was {FLOOR[name]:.3f}; left: {dict(m.left)}")
    codes = {code for code, _, _ in m.left}
    assert codes <= LEFT_CODES.get(name, set()), (name, codes)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_deberta_attention_is_fused_with_its_bias_and_mask(target: str) -> None:
    """DeBERTa-v2: ``bmm(q3, k3^T / sqrt(3 d))`` + the disentangled bias, ``masked_fill(~mask, finfo.min)``,
    softmax, ``bmm(p, v3)``: one attention a layer, the scale read from the constant ops that make it, the
    bias and the fill score mods; matches eager (``measure`` raises where not), a padded row included."""
    model, kw = ff.MODELS["deberta_v2"]()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    m, compiled = ff.measure("deberta_v2", target, model=(model, {**kw, "attention_mask": mask}))
    att = [s for p in compiled.spacefusion.partitions for s in p.subgraphs if s.kind == "attention"]
    assert len(att) == 2 and all("(bmm)" in s.label and "+ bias + masked_fill" in s.label for s in att), att
    # 1 / sqrt(3 * 16) as torch has it: sqrt in float32, the reciprocal in float64
    assert float(dict(att[0].smg.attrs)["scale"]) == 1 / float(torch.sqrt(torch.tensor(48.0)))
    assert m.fused == 24 and m.total == 24  # the 4 c2p / p2c bmm: value GEMMs (``frontend.value_gemm``)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_efficientnet_same_and_valid_paddings_are_fused(target: str) -> None:
    """EfficientNet writes its 1x1 and stride-1 depthwise convs with ``padding="same"`` and its stride-2 ones
    with ``"valid"`` after a ``ZeroPad2d``: read as numbers, every conv is fused (was none), the RGB stem's too
    (issue 56)."""
    m, _ = ff.measure("efficientnet", target)
    assert (m.fused, m.total) == (36, 36), m


def test_an_even_kernels_same_padding_is_still_refused_with_its_reason() -> None:
    """``padding="same"`` of an even kernel pads one more row and column after the image: no symmetric
    padding states it, so the conv stays with torch, said with the padding."""
    conv = torch.nn.Conv2d(8, 8, 2, padding="same")
    compiled = __import__("spacefusion").compile(conv, target="reference")
    x = torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), conv(x))
    left = [op for p in compiled.spacefusion.partitions for op in p.left if op.op.endswith("conv2d")]
    assert left and left[0].code == "conv.form" and "padding same" in left[0].reason, left


def test_coverage_counts_fused_left_and_once_apart() -> None:
    left = (LeftOp("a", "torch.bmm", "why", "left.value_gemm"), LeftOp("c", "F.linear", "x", "left.folded"),
            LeftOp("d", "operator.add", "y", "left.elementwise"))
    part = Partition((), left, heavy=("a", "b", "c"))
    cov = part.coverage()
    assert cov.fused == () and [op.node for op in cov.left] == ["a"] and [op.node for op in cov.once] == ["c"]
    assert cov.total == 1 and cov.fraction == 0.0
    assert (cov + Coverage(("b",), ())).fraction == 0.5
