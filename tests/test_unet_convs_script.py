"""experiments/tuning/unet_convs.py: the candidate batch it measures, and the records it commits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "tuning"))

import unet_convs  # noqa: E402


def test_the_batch_starts_with_the_tuners_order_then_one_pick_per_family() -> None:
    from smg import patterns
    from spacefusion.frontend.schedules import ranked

    g = patterns.conv2d(2, 8, 8, 64, 64, 3, 1, 1, residual=True, dtype="float16")
    got = unet_convs.pick(g, 3, 9)
    order = ranked(g)
    assert [s.key for _, s in got[:3]] == [s.key for s in order[:3]]
    fams = [unet_convs._family(s) for why, s in got[3:] if why.startswith("family")]
    assert fams and len(set(fams)) == len(fams)
    assert not set(fams) & {unet_convs._family(s) for _, s in got[:3]}
    deeper = [s for why, s in got if why.startswith("rank 0 with")]
    assert all(s.block == order[0].block and s.slices == order[0].slices and s.stages > order[0].stages
               for s in deeper)
    assert len({s.key for _, s in got}) == len(got)


def test_the_tile_option_adds_the_best_of_each_tile_shape_the_batch_lacks() -> None:
    from schedulers.hardware import H100
    from search.cost import estimate_us
    from smg import patterns
    from spacefusion.frontend.schedules import ranked

    g = patterns.conv2d(2, 8, 8, 64, 64, 3, 1, 1, residual=True, dtype="float16")
    held = unet_convs.pick(g, 2, 3)
    got = unet_convs.by_tile(g, held, 4)
    shapes = [tuple(s.block) for _, s in got]
    assert got and len(got) <= 4 and len(set(shapes)) == len(shapes)
    assert not set(shapes) & {tuple(s.block) for _, s in held}
    order = [s for s in ranked(g) if s.tensor_cores]
    for _, s in got:  # each the model's first of its shape
        assert s.key == next(t for t in order if t.block == s.block).key
    est = [estimate_us(s, H100) for _, s in got]
    assert est == sorted(est)


def test_the_committed_rounds_are_checked_records_with_cudnn_beside_them() -> None:
    from search.records import MeasureResult

    for name, per in (("unet_convs_h100.json", 15), ("unet_convs_round2_h100.json", 4)):
        data = json.loads((ROOT / "experiments" / "tuning" / name).read_text())
        assert data["format"] == "spacefusion-records/1" and "H100" in data["device"]
        convs = {tuple(r["label"]["conv"]) for r in data["records"]}
        assert convs == {tuple(c[:6]) for c in unet_convs.CONVS}
        for c in convs:
            rows = [r for r in data["records"] if tuple(r["label"]["conv"]) == c]
            assert len(rows) >= per and rows[0]["label"]["why"] == "rank 0"
            # every kernel matched the numpy reference before it was timed (the batch's check)
            assert all(MeasureResult.from_dict(r["result"]).ok and r["result"]["max_abs_err"] is not None for r in rows)
        assert {tuple(c["conv"]) for c in data["cudnn"]} == convs
        assert all(c["cudnn_conv_us"] > 0 for c in data["cudnn"])


def test_the_wide_option_adds_the_best_128_row_form_of_each_tile_slices_and_producer() -> None:
    from schedulers.hardware import H100
    from search.cost import estimate_us
    from smg import patterns

    g = patterns.conv2d(2, 8, 8, 64, 64, 3, 1, 1, residual=True, dtype="float16")  # the first test's: ranked once
    held = unet_convs.pick(g, 1, 1)
    got = unet_convs.by_tile_slices(g, held, 6)
    forms = [(tuple(s.block), s.slices, bool(s.producer)) for _, s in got]
    assert got and len(got) <= 6 and len(set(forms)) == len(forms)
    assert all(s.tma and s.block[0][1] >= 128 and s.key not in {h.key for _, h in held} for _, s in got)
    est = [estimate_us(s, H100) for _, s in got]
    assert est == sorted(est)


def test_the_strided_set_builds_strided_windows_that_tma_im2col_loads() -> None:
    """``--set strided``: each conv's SMG has the stride its key names, and its view is a TMA im2col load
    stepping by it (the map's traversal stride), so the batch measures the TMA families too."""
    from schedulers.gather_tile import Im2col, gather_tile, im2col_of

    assert unet_convs.SETS["small"] is unet_convs.CONVS
    for c in unet_convs.STRIDED:
        key = unet_convs._key(c)
        assert key == [*c[:6], 2] and "/2" in unet_convs._label(c)
        g = unet_convs._smg(c)
        im = im2col_of(g, gather_tile(g, g.producer("A"), "m", "k"))
        assert isinstance(im, Im2col) and im.stride == 2, im
        out = (c[1] + 2 * (c[4] // 2) - c[4]) // 2 + 1
        assert im.out == (out, out)
    assert unet_convs._key(unet_convs.CONVS[0]) == list(unet_convs.CONVS[0][:6])


def test_the_strided_and_large_rounds_are_checked_records_with_cudnn_beside_them() -> None:
    """``unet_convs_strided_h100.json`` (the same batch on an H200 in ``raw/``) and
    ``unet_convs_large_h100.json`` (the 64x64 convs): every built kernel matched
    the numpy reference before it was timed; the two failures are the deeper rings that do not fit in shared
    memory, refused at build with that reason."""

    for name, device, convs in (("unet_convs_strided_h100.json", "H100", unet_convs.STRIDED),
                                ("raw/unet_convs_strided_h200.json", "H200", unet_convs.STRIDED),
                                ("unet_convs_large_h100.json", "H100", unet_convs.LARGE),
                                ("unet_convs_wide16_h100.json", "H100", unet_convs.WIDE16)):
        _checked_round(json.loads((ROOT / "experiments" / "tuning" / name).read_text()), device, convs)


def _checked_round(data: dict, device: str, convs: list[tuple]) -> None:
    from search.records import MeasureResult

    assert data["format"] == "spacefusion-records/1" and device in data["device"]
    want = {tuple(unet_convs._key(c)) for c in convs}
    assert {tuple(r["label"]["conv"]) for r in data["records"]} == want == {tuple(c["conv"]) for c in data["cudnn"]}
    for r in data["records"]:
        res = MeasureResult.from_dict(r["result"])
        assert res.ok == (res.error is None)
        if not res.ok:
            assert "shared memory" in res.error and r["label"]["why"].startswith("rank 0 with")
        else:
            assert r["result"]["max_abs_err"] is not None and r["label"]["tma"] in (True, False)
    # every conv's first pick was a TMA im2col kernel and ran
    for key in want:
        first = next(r for r in data["records"] if tuple(r["label"]["conv"]) == key)
        assert first["label"]["why"] == "rank 0" and first["label"]["tma"] and first["result"]["error"] is None
