"""Which layout a convolution reads an NCHW image in, decided by the search's cost model.

A convolution of an image that lies NCHW (torch's default) has two ways to run:
- read it where it lies (``patterns.conv2d(layout="nchw")``): the im2col tile gathered element by element;
- copy it channels-last first (the binding's ``contiguous(memory_format=channels_last)``) and run the
  channels-last kernel, whose tile is gathered in 16-byte runs or by TMA im2col.

``choose_layout`` prices both with the analytical model (``search.cost``): each conv's first pick, and the copy
as the ``patterns.to_channels_last`` SMG's.  On the H200 the model's copy estimates were 153.5, 39.9, 77.7 and
13.4 us where torch's copy measured 151.9, 34.6, 67.6 and 14.2 (ResNet-50's four chain inputs at batch 32,
``experiments/results/conv_chains_nchw_h200.json``; the decisions against that run: ``conv_layouts_h200.json``).
The decision needs the cost model (islpy), which the GPU machine lacks, so an export records it beside the
kernels (``layouts.json``, as ``split.json`` records a split) and the GPU machine reads it back
(``CudaBackend.layout_of``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from schedulers.gather_tile import CHUNK
from schedulers.hardware import HardwareModel
from smg import patterns
from smg.ir import SMG

#: the decision's version: a record written under another is derived again
LAYOUT_RULE = 1
#: how much faster the NCHW estimate must be than the copy + channels-last kernel's.  The scalar gather's
#: estimates are the least certain the model makes (rms log error 0.44 on the 12 measured candidates, against
#: about 0.3 for the channels-last convs'): where the two are close, the layout the other kernels share wins
NCHW_MARGIN = 1.25
#: the margin where the channels-last kernel gathers element by element too (fewer than 8 channels a run: an RGB
#: stem, whose K is padded, ``convs.k_align``): the two kernels' estimates are then equally uncertain, and the
#: copy alone separates them
SCALAR_MARGIN = 1.0
LAYOUTS = ("nchw", "nhwc")


@dataclass(frozen=True)
class LayoutChoice:
    """A convolution's layout and the estimates (us, on ``hardware``) it was chosen by."""

    layout: str
    nchw_us: float
    nhwc_us: float
    copy_us: float
    hardware: str
    rule: int = LAYOUT_RULE
    margin: float = NCHW_MARGIN  # how much faster the NCHW estimate had to be (``SCALAR_MARGIN`` for a stem)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown image layout {self.layout!r}; known: {LAYOUTS}")

    @property
    def reason(self) -> str:
        if math.isnan(self.nchw_us):
            return f"copied channels-last first: no cost model here to price reading it NCHW ({self.hardware})"
        read = "read NCHW where it lies" if self.layout == "nchw" else "copied channels-last first"
        return (f"{read}: the model's {self.nchw_us:.1f} us read NCHW against {self.copy_us:.1f} + "
                f"{self.nhwc_us:.1f} us copied ({self.hardware}; NCHW needs a {self.margin:g}x margin"
                f"{', both gathered element by element' if self.margin == SCALAR_MARGIN else ''})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LayoutChoice:
        """A recorded choice; ValueError for another rule's (derived again) or a damaged record."""
        if d.get("rule") != LAYOUT_RULE:
            raise ValueError(f"a layout decided by rule {d.get('rule')}, this code's is {LAYOUT_RULE}")
        try:
            return cls(str(d["layout"]), float(d["nchw_us"]), float(d["nhwc_us"]), float(d["copy_us"]),
                       str(d["hardware"]), int(d["rule"]), float(d.get("margin", NCHW_MARGIN)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a damaged layout record {d!r}: {exc}") from exc


def copy_of(nchw: SMG) -> SMG:
    """The channels-last copy of the NCHW conv ``nchw``'s image."""
    x = nchw.space("X")
    n, c, h, w = (nchw.dim_sizes[d] for d in x.dims)
    return patterns.to_channels_last(n, c, h * w, x.dtype)


def choose_layout(nchw: SMG, nhwc: SMG, hw: HardwareModel) -> LayoutChoice:
    """Price the NCHW conv ``nchw`` against the channels-last copy of its image plus ``nhwc`` (the same conv
    channels-last) on ``hw``: each as its first pick's estimate (``schedules.ranked``: the schedule the export
    then builds).  Needs the cost model (islpy)."""
    from search.cost import estimate_us
    from spacefusion.frontend.schedules import ATTEMPTS, ranked

    def best(smg: SMG) -> float:
        order = ranked(smg, hw, head=ATTEMPTS)  # the head the export's first pick ranks (cached for it)
        return estimate_us(order[0], hw) if order else float("inf")

    a, b, copy = best(nchw), best(nhwc), best(copy_of(nchw))
    x = nhwc.space("X")
    margin = SCALAR_MARGIN if nhwc.dim_sizes[x.dims[-1]] % CHUNK else NCHW_MARGIN
    return LayoutChoice("nchw" if a * margin < copy + b else "nhwc", a, b, copy, hw.name, margin=margin)


def decide(nchw: SMG, nhwc: SMG, hw: HardwareModel) -> LayoutChoice:
    """``choose_layout``, or channels-last (the layout every conv kernel takes) where the cost model is not
    installed (the GPU machine: an export's ``layouts.json`` carries the decision there)."""
    try:
        return choose_layout(nchw, nhwc, hw)
    except ImportError as exc:
        return LayoutChoice("nhwc", math.nan, math.nan, math.nan, f"{hw.name}, {exc}")
