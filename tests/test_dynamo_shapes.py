"""A graph's ``tensor_meta`` is read from Dynamo's own fake values where every node has one of whole-number
sizes (``compiled.dynamo_shapes``): the same metadata ShapeProp computes by running the graph again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend.compiled import dynamo_shapes, lift_parameters

transformers = pytest.importorskip("transformers")


def _models() -> dict:
    torch.manual_seed(0)
    bert = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                   vocab_size=100)
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    t5 = transformers.T5Config(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, vocab_size=100)
    return {"bert": transformers.BertModel(bert).eval(), "bert_fp16": transformers.BertModel(bert).eval().half(),
            "gpt2": transformers.GPT2Model(gpt2).eval(), "t5": transformers.T5EncoderModel(t5).eval()}


@pytest.mark.parametrize("name", ["bert", "bert_fp16", "gpt2", "t5"])
def test_dynamos_fake_values_give_shapeprops_metadata(name: str) -> None:
    model, compared = _models()[name], []

    def both(gm: fx.GraphModule, example_inputs: list) -> object:
        fast = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        slow = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        lift_parameters(fast, example_inputs)
        lift_parameters(slow, example_inputs)
        assert dynamo_shapes(fast)
        with torch.no_grad():
            ShapeProp(slow, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)
        for a, b in zip(fast.graph.nodes, slow.graph.nodes, strict=True):
            assert str(a.meta.get("tensor_meta")) == str(b.meta.get("tensor_meta")), a.format_node()
            assert a.meta.get("type") == b.meta.get("type"), a.format_node()
        compared.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=both, dynamic=False)(input_ids=torch.randint(0, 100, (2, 16)))
    assert compared and sum(compared) > 50, compared


def test_a_symbolic_graph_is_left_to_shapeprop() -> None:
    got = []

    def record(gm: fx.GraphModule, example_inputs: list) -> object:
        got.append(dynamo_shapes(fx.GraphModule(gm, copy.deepcopy(gm.graph))))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.relu(x) * 2, backend=record, dynamic=True)
    f(torch.randn(4, 8))
    assert got == [False]
