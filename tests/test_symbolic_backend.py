"""Issue 55 through the Dynamo backend on llvm: a graph with symbolic sizes builds its GEMMs (and row norms, the
embeddings' gathered one included) once, with the rows a run-time size, and every later length within the
kernel's range reuses them; each call checked against eager."""

from __future__ import annotations

import json

import pytest
import torch

from spacefusion.frontend.backends import LLVMBackend
from spacefusion.frontend.dynamo import SpaceFusionBackend

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bert() -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=100)
    return transformers.BertModel(cfg).eval()


def _run(model, compiled, s: int) -> None:
    ids = torch.randint(0, 100, (2, s), generator=torch.Generator().manual_seed(s))
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state,
                                   rtol=1e-4, atol=1e-4)


def test_new_lengths_in_range_build_no_gemm() -> None:
    """Seq 16 is Dynamo's static graph (static kernels); 24 recompiles with symbolic sizes and builds each GEMM
    and norm with m = 2 * seq a run-time size over [24, 96], and the embeddings' gathered LayerNorm (its rows the
    ids' [batch, seq], ``smg.loads``) with seq a run-time size over [12, 48]; 20 and 30 (m = 40, 60) build only
    their attention (its kv length changes too): every GEMM, the plain norms and the embeddings' norm are
    served by the kernels of 24, and each output matches eager."""
    model, kernels = _bert(), LLVMBackend()
    compiled = torch.compile(model, backend=SpaceFusionBackend(kernels))
    built_at = {}
    for s in (16, 24, 20, 30):
        before = len(kernels.builds)
        _run(model, compiled, s)
        built_at[s] = kernels.builds[before:]
    assert all(how == "static" for _, how in built_at[16])
    gemms_24 = [n for n, how in built_at[24] if "gemm" in n]
    assert len(gemms_24) >= 4 and all(how == "symbolic" for n, how in built_at[24] if "gemm" in n), built_at[24]
    assert dict(built_at[24])["embedding2_layernorm"] == "symbolic", built_at[24]
    for s in (20, 30):  # no GEMM and no norm built: the attention alone (its key length is a reduced dim)
        assert [n for n, _ in built_at[s]] == ["attention"], built_at[s]
        assert not any("gemm" in n or "norm" in n for n, _ in built_at[s]), built_at[s]
    reused = kernels.symbolic.reused
    assert sum("gemm" in n for n in reused) == 2 * len(gemms_24), reused  # each GEMM of 24, at 20 and at 30
    assert "residual_layernorm" in reused, reused
    assert reused.count("embedding2_layernorm") == 2, reused  # the gathered norm of 24, at 20 and at 30
    bad = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(5))
    bad[1, 3] = 100  # past the table, at a length the symbolic kernel serves: raises as eager does
    with torch.no_grad(), pytest.raises(IndexError, match="out of range"):
        compiled(input_ids=bad)
    assert len(kernels.builds) == sum(map(len, built_at.values()))  # nothing built for it


def test_a_length_outside_the_range_builds_again() -> None:
    """m = 2 * 48 = 96 is the top of 24's range [24, 96]; m = 2 * 64 = 128 is past it: its GEMMs are built anew
    (symbolic over their own range), and the outputs still match eager."""
    model, kernels = _bert(), LLVMBackend()
    compiled = torch.compile(model, backend=SpaceFusionBackend(kernels))
    for s in (16, 24):
        _run(model, compiled, s)
    before = len(kernels.builds)
    _run(model, compiled, 48)
    assert not any("gemm" in n for n, _ in kernels.builds[before:]), kernels.builds[before:]
    before = len(kernels.builds)
    _run(model, compiled, 64)
    assert sum("gemm" in n and how == "symbolic" for n, how in kernels.builds[before:]) >= 4


def test_static_graphs_and_tuned_schedules_keep_static_kernels() -> None:
    """Outside ``sizes_per_call`` nothing is symbolic; with a schedule_for other than the default (a tuning
    database's pick per size) the per-call sizes build static kernels as before."""
    kernels = LLVMBackend()
    with kernels.sizes_per_call():
        assert kernels.per_call
    assert not kernels.per_call
    tuned = LLVMBackend(schedule_for=lambda smg: kernels.schedule_for(smg))
    with tuned.sizes_per_call():
        assert not tuned.per_call


def test_the_cuda_backend_exports_one_artefact_for_a_range_of_rows(tmp_path) -> None:
    """Inside ``sizes_per_call`` a CUDA-core GEMM is exported once with m a run-time size over [m/2, 2m]
    (format /2 under the folder's ``symbolic/``); another m of its family in range is served by it with no
    export, also to a fresh backend on the folder (the index is on disk); m past the range exports again; a
    static compile keeps its own static artefact.  Export only: no GPU here."""
    from smg.patterns import gemm_epilogue
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.runtime.artefact import SYMBOLIC_FORMAT_TAG, KernelArtefact

    def gemm(m: int):
        return gemm_epilogue(m, 64, 32, act="gelu", dtype="float32")

    def exports(folder) -> int:
        return len(list(folder.rglob("timing.json")))

    kernels = CudaBackend(tmp_path, build_missing=True, load=False, symbolic=True)
    with kernels.sizes_per_call():
        kernels.compile(gemm(48))
        assert exports(tmp_path) == 1
        art = KernelArtefact.load(kernels.artefact_path(gemm(48)))
        assert art.to_meta()["format"] == SYMBOLIC_FORMAT_TAG and (art.symbolic.lo, art.symbolic.hi) == (24, 96)
        for m in (24, 40, 96):
            kernels.compile(gemm(m))
            assert kernels.artefact_path(gemm(m)) == art.folder
        assert exports(tmp_path) == 1
        kernels.compile(gemm(97))
        assert exports(tmp_path) == 2 and kernels.artefact_path(gemm(97)) != art.folder
    fresh = CudaBackend(tmp_path, build_missing=True, load=False, symbolic=True)
    with fresh.sizes_per_call():
        fresh.compile(gemm(60))
    assert exports(tmp_path) == 2
    fresh.compile(gemm(60))  # a static graph's compile: its own artefact, as before
    assert exports(tmp_path) == 2  # the kernel of this SMG key was compiled above: cached
    static = CudaBackend(tmp_path, build_missing=True, load=False, symbolic=True)
    static.compile(gemm(60))
    assert exports(tmp_path) == 3 and KernelArtefact.load(static.artefact_path(gemm(60))).symbolic is None
    tuned = CudaBackend(tmp_path, build_missing=True, load=False, by_schedule=True, symbolic=True)  # a database's picks
    with tuned.sizes_per_call():
        assert not tuned.symbolic_rows and tuned.artefact_path(gemm(60)) == tuned.artefact_dir(gemm(60))
    default = CudaBackend(tmp_path, build_missing=True, load=False)  # opt-in until checked on a GPU
    with default.sizes_per_call():
        assert not default.symbolic_rows and default.artefact_path(gemm(40)) == default.artefact_dir(gemm(40))


def test_the_cuda_backend_runs_a_served_kernel_at_its_own_rows(tmp_path, monkeypatch) -> None:
    """The CUDA backend's call of a served symbolic artefact, the GPU launch stood in for by the numpy
    reference (no GPU here): each SMG's tensors are viewed at its own rows, not the artefact's, and its
    outputs come back in its shapes."""
    import numpy as np

    import spacefusion.runtime.gpu as gpu
    from smg import evaluate, random_inputs
    from smg.patterns import gemm_epilogue
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.runtime.artefact import KernelArtefact

    def gemm(m: int):
        return gemm_epilogue(m, 64, 32, act="gelu", dtype="float32")

    calls: list[dict] = []

    class Launch:  # what the runtime's CudaKernel does, on the CPU: read m from the inputs, compute the graph
        def __init__(self, path) -> None:
            self.artefact = KernelArtefact.load(path)

        def __call__(self, **xs: torch.Tensor) -> dict[str, torch.Tensor]:
            shapes = {k: tuple(v.shape) for k, v in xs.items()}
            m = self.artefact.symbolic.size_of(shapes)
            calls.append(shapes)
            ref = evaluate(gemm(m), {k: v.numpy() for k, v in xs.items()})
            return {k: torch.from_numpy(v.astype(np.float32)) for k, v in ref.items()}

    monkeypatch.setattr(gpu, "load_kernel", Launch)
    kernels = CudaBackend(tmp_path, build_missing=True, symbolic=True)
    with kernels.sizes_per_call():
        kernels.compile(gemm(48))
        run = kernels.compile(gemm(40))
        served = kernels.artefact_path(gemm(40))
        assert served == kernels.artefact_path(gemm(48)) and KernelArtefact.load(served).symbolic is not None
    x = random_inputs(gemm(40), seed=3)
    got = run({k: torch.from_numpy(v) for k, v in x.items()})
    assert calls[-1]["A"] == (40, 32) and got["Y"].shape == (40, 64)
    np.testing.assert_allclose(got["Y"].numpy(), evaluate(gemm(40), x)["Y"], rtol=1e-5, atol=1e-5)


def test_the_cuda_backend_exports_a_tensor_core_gemm_for_a_range_of_rows(tmp_path) -> None:
    """BERT-base's attention output projection in fp16: its pick on the H100 runs on tensor cores (a warp-tile
    program, wgmma); inside ``sizes_per_call`` it
    is exported once with m a run-time size, its tensor maps encoded by the launcher at each size, and a later
    m of its family in range is served by that artefact.  Export only: no GPU here."""
    from smg.patterns import gemm_epilogue
    from spacefusion.api import hardware
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.dynamo import first_pick_for
    from spacefusion.runtime.artefact import SYMBOLIC_FORMAT_TAG, KernelArtefact

    def gemm(m: int):
        return gemm_epilogue(m, 768, 768, act="none", dtype="float16", b_layout="nk")

    kernels = CudaBackend(tmp_path, build_missing=True, load=False, schedule_for=first_pick_for(hardware("h100")),
                          symbolic=True)
    with kernels.sizes_per_call():
        kernels.compile(gemm(1024))
        folder = kernels.artefact_path(gemm(1024))
        meta = json.loads((folder / "kernel.json").read_text())
        assert meta["format"] == SYMBOLIC_FORMAT_TAG and meta["symbolic"]["range"] == [512, 2048]
        assert "wgmma" in (folder / "kernel.cu").read_text()  # the warp-tile program on tensor cores
        assert KernelArtefact.load(folder).symbolic is not None
        kernels.compile(gemm(1500))
        assert kernels.artefact_path(gemm(1500)) == folder
