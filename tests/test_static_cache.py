"""Decoding with HF's ``StaticCache`` (K and V written in place at ``cache_position``): the fused model matches
eager step after step, and a CUDA graph replay leaves its writes in the caller's cache."""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
from torch import fx

transformers = pytest.importorskip("transformers")

import spacefusion  # noqa: E402
from spacefusion.frontend.replay import mutated_inputs  # noqa: E402

PROMPT, STEPS, MAX_LEN = 12, 3, 32


def _llama(family: str = "Llama") -> torch.nn.Module:
    """A tiny GQA decoder of ``family`` (``Llama``, or ``Qwen2``: q/k/v biases): 4 query heads over 2 kv heads."""
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                   max_position_embeddings=128)
    return getattr(transformers, f"{family}Model")(cfg).eval()


def _cache_kwarg(model: torch.nn.Module) -> str:
    """``cache`` where ``transformers`` takes it (its ``past_key_values`` alias warns on every call)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decode(model, ids: torch.Tensor, mask: torch.Tensor | None = None
            ) -> tuple[list[torch.Tensor], transformers.StaticCache]:
    """A prefill of ``ids`` then STEPS one-token steps, each step's input the previous step's last token; with
    ``mask`` (the prompt's padding, [batch, PROMPT]), each call gets the attention mask so far."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    outs = []
    masked = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad():
        out = model(input_ids=ids, **{_cache_kwarg(model): cache}, use_cache=True,
                    cache_position=torch.arange(PROMPT, device=ids.device), **masked)
        outs.append(out.last_hidden_state.clone())
        tok = ids[:, -1:]
        for i in range(STEPS):
            pos = torch.tensor([PROMPT + i], device=ids.device)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                masked = {"attention_mask": mask}
            out = model(input_ids=tok, **{_cache_kwarg(model): cache}, use_cache=True, cache_position=pos, **masked)
            outs.append(out.last_hidden_state.clone())
            tok = (tok * 7 + 3) % model.config.vocab_size
    return outs, cache


def test_a_graph_that_writes_an_input_in_place_says_which() -> None:
    def f(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, x)
        view = other[0]
        view.add_(1)  # through a view
        return cache.sum() + x * 2

    gm = fx.symbolic_trace(f)
    assert mutated_inputs(gm) == {0, 3}

    def g(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b).relu()

    assert mutated_inputs(fx.symbolic_trace(g)) == set()

    graph = fx.Graph()  # as Dynamo records them: ``a[:, 0] = b.sum(1)`` and ``torch.Tensor.copy_(c, b)``
    a, b, c = (graph.placeholder(n) for n in "abc")
    total = graph.call_method("sum", (b, 1))
    graph.call_function(operator.setitem, (a, (slice(None), 0), total))
    graph.call_function(torch.Tensor.copy_, (c, b))
    graph.output(graph.call_function(operator.mul, (a, 2)))
    assert mutated_inputs(fx.GraphModule(torch.nn.Module(), graph)) == {0, 2}


def test_static_cache_decoding_matches_eager_and_only_the_cache_is_written() -> None:
    model = _llama()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    want, want_cache = _decode(model, ids)
    seen: list[tuple[set[int], list]] = []

    def spy(gm: fx.GraphModule, example_inputs: list) -> object:
        seen.append((mutated_inputs(gm), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    _, spy_cache = _decode(torch.compile(model, backend=spy), ids)
    kv = {id(t) for layer in spy_cache.layers for t in (layer.keys, layer.values)}
    decode_graphs = 0
    for mutated, inputs in seen:  # every K and V a graph reads as an input, it writes (and says so)
        reads = {i for i, t in enumerate(inputs) if id(t) in kv}
        assert reads <= mutated, (reads, mutated)
        decode_graphs += len(reads) == 2 * len(model.layers)
    assert decode_graphs >= 1, [m for m, _ in seen]

    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target="reference")
    got, got_cache = _decode(compiled, ids)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for a, b in zip(want_cache.layers, got_cache.layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-4)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert sum(lab.startswith("attention") for lab in labels) >= 2 * len(model.layers), labels
    # GQA throughout: the prefill's SDPA has enable_gqa, the decode steps' K/V go through repeat_kv (issue 57)
    assert all("h4/2" in lab for lab in labels if lab.startswith("attention")), labels


def _expands_left(compiled) -> list[str]:
    """The 5-d ``expand`` nodes torch still runs in the fused graphs: ``repeat_kv``'s [b, hk, r, s, d] copies of
    K and V (the attention mask's expand has 4 dims)."""
    left = []
    for cg in compiled.spacefusion.compiled:
        for node in cg.fused.graph_module.graph.nodes:
            if node.op == "call_method" and node.target == "expand" and len(node.args) == 6:
                left.append(node.name)
    return left


@pytest.mark.parametrize("target", ["reference", "llvm"])
@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_gqa_decoding_with_a_padding_mask_reads_each_kv_head_once(family: str, target: str) -> None:
    """Issue 57: HF's sdpa path under ``torch.compile`` with a mask repeats K and V per query head
    (``repeat_kv``: expand + reshape) before SDPA.  The decode steps' attention takes the repeats in and reads the
    StaticCache's K/V per kv head (``h4/2``, K bound [b, 2, cache, d]), no repeat left to torch; every step
    matches eager with a left-padded batch.  So does the prefill, whose mask is causal and the padding row
    together (a padded query row keeps no key: 0, as SDPA's, through -inf fills, ``_padded_index_mask``)."""
    model = _llama(family)
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :4] = 0  # the second prompt left-padded by 4
    want, want_cache = _decode(model, ids, mask)
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target=target)
    got, got_cache = _decode(compiled, ids, mask)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for a, b in zip(want_cache.layers, got_cache.layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
    report = compiled.spacefusion
    att = [s for p in report.partitions for s in p.subgraphs if s.kind == "attention"]
    decode = [s for s in att if " 1x" in s.label]
    assert len(decode) >= 2 * len(model.layers) and all("h4/2" in s.label for s in decode), [s.label for s in att]
    for sub in decode:
        k = next(op for op in sub.operands if op.space == "K")
        assert k.shape == (2, 2, MAX_LEN, 16), k
        assert sum(n.startswith(("key", "value")) for n in sub.nodes) == 2, sub.nodes  # both reshapes taken in
    prefill = [s for s in att if f" {PROMPT}x{MAX_LEN} " in s.label]
    assert len(prefill) == len(model.layers) and all("h4/2" in s.label for s in prefill), [s.label for s in att]
    assert _expands_left(compiled) == [], _expands_left(compiled)
    assert "attention.kv_repeat" not in str(report) and "attention.mask" not in str(report), str(report)


@pytest.mark.cuda
@pytest.mark.parametrize("fused_writes", [False, True])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_static_cache_decoding_replays_into_the_callers_cache_on_the_gpu(mode: str | None, fused_writes: bool,
                                                                         tmp_path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU as CUDA graph replays: every step's output within a few times eager fp16's distance
    from float32, and the cache the caller holds afterwards is eager's (the replay's writes land there).
    ``fused_writes``: with the KV-cache writes in RoPE's kernel (``frontend.kv_cache``), which the GPU backend
    leaves to torch by default (``CudaBackend.library_first["kv_cache_write"]``) until this test has passed."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.frontend.backends import CudaBackend

    if fused_writes:
        monkeypatch.setattr(CudaBackend, "library_first",
                            {k: v for k, v in CudaBackend.library_first.items() if k != "kv_cache_write"})
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    model = _llama().cuda()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    exact, _ = _decode(model, ids)
    model.half()
    eager, eager_cache = _decode(model, ids)
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, mode=mode, measure=False)
    got, got_cache = _decode(compiled, ids)
    report = compiled.spacefusion
    assert report.target == "cuda" and any(g.replayed for g in report.graphs), str(report)
    assert ("index_copy_" in str(report)) != fused_writes, str(report)
    for e, g, x in zip(eager, got, exact):
        eager_err = (e.float() - x).abs().max().item()
        ours = (g.float() - x).abs().max().item()
        assert ours <= 4 * eager_err + 1e-3, f"fused fp16 off by {ours}, eager fp16 by {eager_err}\n{report}"
    for a, b in zip(eager_cache.layers, got_cache.layers):
        assert (b.keys[:, :, PROMPT + STEPS:] == 0).all()  # nothing past the last step was written
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert (x - y).abs().max().item() <= 1e-2, (x - y).abs().max().item()


def _early_cache(model: torch.nn.Module, batch: int) -> transformers.StaticCache:
    """A StaticCache allocated before the first call (``early_initialization``): the prefill graph then reads
    its K/V as inputs too (a lazily made cache is a constant of the prefill's graph, written by torch)."""
    cfg = model.config
    cache = transformers.StaticCache(config=cfg, max_cache_len=MAX_LEN)
    cache.early_initialization(batch, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                               torch.float32, torch.device("cpu"))
    return cache


def _steps(model, ids: torch.Tensor, cache) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """A prefill of ``ids`` then STEPS one-token steps into ``cache``; after each call, its output and a copy
    of every layer's K and V cache."""
    out, tok = [], ids
    with torch.no_grad():
        for pos in [torch.arange(PROMPT)] + [torch.tensor([PROMPT + i]) for i in range(STEPS)]:
            got = model(input_ids=tok, **{_cache_kwarg(model): cache}, use_cache=True, cache_position=pos)
            caches = [t.clone() for lay in cache.layers for t in (lay.keys, lay.values)]
            out.append((got.last_hidden_state.clone(), caches))
            tok = (tok[:, -1:] * 7 + 3) % model.config.vocab_size
    return out


@pytest.mark.parametrize("target", ["reference", "llvm"])
@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_rope_kernels_write_the_kv_caches_at_prefill_and_decode(family: str, target: str) -> None:
    """Issue 57: each layer's K RoPE kernel stores K into the key cache and carries V into the value cache at
    ``cache_position`` (``smg.stores``), so no ``index_copy_`` is left to torch; every call's output and the
    caller's caches match eager's after the prefill (12 positions) and after each decode step, GQA, batch 2."""
    model = _llama(family)
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    want = _steps(model, ids, _early_cache(model, 2))
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target=target)
    cache = _early_cache(compiled, 2)
    caller = [t for lay in cache.layers for t in (lay.keys, lay.values)]
    got = _steps(compiled, ids, cache)
    for (w, wc), (g, gc) in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        for a, b in zip(wc, gc):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert all(a is b for a, b in zip(caller, (t for lay in cache.layers for t in (lay.keys, lay.values))))
    report = compiled.spacefusion
    writers = [s for p in report.partitions for s in p.subgraphs if s.label.endswith("-> K, V caches")]
    assert {s.label.split(" ")[3] for s in writers} == {f"s{PROMPT}", "s1"}, [s.label for s in writers]
    assert all(len(s.writes) == 2 and not s.results for s in writers)
    left = [op for p in report.partitions for op in p.left if op.op == "Tensor.index_copy_"]
    assert left == [], left


def test_a_lazily_made_cache_is_left_to_torch_with_its_reason() -> None:
    """The prefill of a cache made on first use: its K/V are made inside the graph, not the caller's inputs, so
    its writes stay with torch under ``kv_cache.write`` (the decode steps' are taken)."""
    model = _llama()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target="reference")
    _decode(compiled, ids)
    left = [op for p in compiled.spacefusion.partitions for op in p.left if op.code == "kv_cache.write"]
    assert len(left) == len(model.layers) and all("made inside the graph" in op.reason for op in left), left
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert sum(lab.endswith("-> K, V caches") for lab in labels) >= len(model.layers), labels
