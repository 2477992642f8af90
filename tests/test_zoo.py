"""The model zoo through the importer: FLOPs, eager equality, real structure."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opsched.errors import ModelImportError
from opsched.importers.torch_fx import from_torch
from opsched.zoo import ZOO, get_zoo_model
from opsched.zoo.inception import InceptionA


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread: results are the same, and the many tiny ops of these
    graphs do not spin OpenMP teams on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Tests run the zoo at half width: the same graph structure (op count, wiring)
#: as the defaults, a quarter of the arithmetic.
WIDTH = 0.5


@pytest.fixture(scope="module", params=list(ZOO))
def imported(request):
    """(name, module, inputs, graph, eager output, FlopCounterMode total) per zoo model."""
    module, inputs = ZOO[request.param].build(batch=1, width=WIDTH)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        ref = module(*inputs)
    graph = from_torch(module, inputs, name=request.param)
    return request.param, module, inputs, graph, ref, fc.get_total_flops()


def _random_topo_run(graph, inputs, seed: int):
    """Execute the compiled ops in a random topological order of the graph."""
    src = graph.source
    rng = random.Random(seed)
    compiled = {c.op_id: c for c in src.compile_ops()}
    indeg = [len(p) for p in graph.pred_index]
    ready = [i for i, d in enumerate(indeg) if d == 0]
    values = src.new_values(*inputs)
    with torch.no_grad():
        while ready:
            i = ready.pop(rng.randrange(len(ready)))
            compiled[graph.ops[i].id].run(values)
            for j in graph.succ_index[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    ready.append(j)
    return src.collect_output(values)


def test_registry_entries_are_described():
    assert set(ZOO) == {"inception", "resnet50", "nasnet", "randwire", "lstm", "transformer"}
    for name, z in ZOO.items():
        assert z.name == name and z.description and "\n" not in z.description
    with pytest.raises(ModelImportError, match="inception"):
        get_zoo_model("vgg")


def test_total_flops_match_flop_counter_for_the_whole_model(imported):
    name, _, _, g, _, expected = imported
    assert expected > 0
    assert abs(g.total_flops - expected) <= 0.01 * expected, name


def test_size_is_a_real_network_shape(imported):
    name, _, _, g, _, _ = imported
    assert 90 <= len(g.ops) <= 800, (name, len(g.ops))
    kinds = {op.kind for op in g.ops}
    assert ("conv" in kinds) or ("matmul" in kinds)
    assert all(op.bytes_written >= 0 and op.bytes_read >= 0 for op in g.ops)


def test_node_by_node_and_any_topological_order_equal_eager(imported):
    name, _, inputs, g, ref, _ = imported
    assert torch.equal(g.source.run_node_by_node(*inputs), ref), name
    # the graph's edges are all the dependencies there are: any valid order works
    assert torch.equal(_random_topo_run(g, inputs, seed=1), ref), name


def test_multi_branch_models_have_parallel_width(imported):
    name, _, _, g, _, _ = imported
    minimum = {"inception": 4, "nasnet": 5, "randwire": 5, "lstm": 2, "resnet50": 2, "transformer": 2}
    assert g.width() >= minimum[name], (name, g.width())


def test_inception_block_branches_are_independent_paths():
    block = InceptionA(32, 16, 0.25).eval()
    g = from_torch(block, (torch.randn(1, 32, 9, 9),))
    assert g.width() >= 4
    first = {b: next(op.id for op in g.ops if op.name.startswith(f"{b}.0")) for b in ("b1", "b5_1", "b3_1", "bp")}
    reach = {}
    for b, op_id in first.items():
        seen, stack = set(), [op_id]
        while stack:
            for s in g.successors(stack.pop()):
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        reach[b] = seen
    for a in first:
        for b in first:
            if a != b:
                assert first[b] not in reach[a], f"branch {a} should not reach branch {b}"
    # all branches meet at the concat
    cat = next(op.id for op in g.ops if op.kind == "concat_split")
    assert all(cat in r for r in reach.values())


def test_batch_scales_flops_and_shapes():
    z = ZOO["transformer"]
    g1, g2 = z.graph(batch=1, width=0.25), z.graph(batch=2, width=0.25)
    assert len(g1.ops) == len(g2.ops)
    assert g2.total_flops == pytest.approx(2 * g1.total_flops, rel=0.01)
    assert g2.ops[-1].shape[0] == 2


def test_width_scales_channels():
    z = ZOO["lstm"]
    narrow, wide = z.graph(width=0.25), z.graph(width=0.5)
    assert len(narrow.ops) == len(wide.ops)
    assert wide.total_flops > 2.5 * narrow.total_flops  # GEMMs grow with hidden size squared


def test_randwire_wiring_and_weights_come_from_the_seed():
    z = ZOO["randwire"]
    (m1, _), (m2, _), (m3, _) = (z.build(width=0.25, seed=s) for s in (3, 3, 4))
    wiring = [[st.preds for st in m.stages] for m in (m1, m2, m3)]
    assert wiring[0] == wiring[1] and wiring[0] != wiring[2]
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True))
    # the stages really are random graphs: some node has several inputs
    assert any(len(p) > 1 for st in m1.stages for p in st.preds)


def test_build_rejects_bad_sizes():
    with pytest.raises(ModelImportError, match="batch"):
        ZOO["lstm"].build(batch=0)
    with pytest.raises(ModelImportError, match="width"):
        ZOO["lstm"].build(width=0)
