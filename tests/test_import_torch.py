"""The PyTorch importer: structure, fusion, FLOPs, compiled ops and errors."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opsched.errors import ModelImportError
from opsched.importers.torch_fx import CompiledOp, Slot, TorchSource, from_torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread: results are the same, and the many tiny ops of these
    graphs do not spin OpenMP teams on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Branchy(nn.Module):
    """Two conv branches, a concat, a view with a size() call, a chunk, and a
    dict/tuple output that also carries a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(3, 8, 1)
        self.fc = nn.Linear(16 * 8 * 8, 10)
        self.w = nn.Parameter(torch.randn(10, 10))

    def forward(self, x: torch.Tensor):
        a = F.relu(self.c1(x))
        b = self.c2(x).sigmoid()
        y = torch.cat([a, b], 1)
        y = y.view(y.size(0), -1)
        z = self.fc(y) @ self.w
        q, r = z.chunk(2, dim=1)
        return {"out": q + r, "z": (z, x.shape[0])}


def _reachable(g, src: str) -> set[str]:
    seen, stack = set(), [src]
    while stack:
        for s in g.successors(stack.pop()):
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen


def _random_topo_run(src: TorchSource, graph, inputs, seed: int):
    """Run the compiled ops in a random topological order of the graph's edges."""
    rng = random.Random(seed)
    compiled = {c.op_id: c for c in src.compile_ops()}
    indeg = {op.id: len(graph.predecessors(op.id)) for op in graph.ops}
    ready = [k for k, d in indeg.items() if d == 0]
    values = src.new_values(*inputs)
    with torch.no_grad():
        while ready:
            op_id = ready.pop(rng.randrange(len(ready)))
            compiled[op_id].run(values)
            for s in graph.successors(op_id):
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
    return src.collect_output(values)


@pytest.fixture(scope="module")
def branchy():
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 8, 8)
    return m, x, from_torch(m, (x,))


def test_every_computing_node_is_in_exactly_one_op(branchy):
    m, x, g = branchy
    src = g.source
    assert isinstance(src, TorchSource)
    computing = [n.name for n in src.gm.graph.nodes if n.op.startswith("call_")]
    executed = [name for names in src.op_nodes.values() for name in names]
    assert sorted(executed) == sorted(computing)
    assert len(executed) == len(set(executed))
    assert list(src.op_nodes) == [op.id for op in g.ops] == list(src.op_order)
    non_ops = {n.name for n in src.gm.graph.nodes if n.op in ("placeholder", "get_attr", "output")}
    assert not non_ops & set(g.index)


def test_bookkeeping_is_fused_and_kinds_are_canonical(branchy):
    _, _, g = branchy
    nodes = g.source.op_nodes
    assert nodes["cat"] == ("cat", "size", "view")  # size()/view join the concat that produced them
    assert nodes["chunk"][0] == "chunk" and all(n.startswith("getitem") for n in nodes["chunk"][1:])
    kinds = {op.id: op.kind for op in g.ops}
    assert kinds["c1"] == "conv" and kinds["fc"] == "matmul" and kinds["matmul"] == "matmul"
    assert kinds["relu"] == "elementwise" and kinds["cat"] == "concat_split"


def test_op_fields_come_from_tensors(branchy):
    _, x, g = branchy
    c1 = g.op("c1")
    assert c1.shape == (2, 8, 8, 8) and c1.dtype == "float32"
    assert c1.param_bytes == (8 * 3 * 9 + 8) * 4
    assert c1.bytes_written == 2 * 8 * 8 * 8 * 4
    assert c1.bytes_read == x.numel() * 4 + c1.param_bytes
    assert c1.flops == 2 * 2 * 8 * 8 * 8 * 3 * 9  # 2 * batch * out pixels * cout * cin * k*k
    # the matmul reads the get_attr parameter w: counted as its parameter bytes
    assert g.op("matmul").param_bytes == 10 * 10 * 4
    edge = {(e.src, e.dst): e.bytes for e in g.edges}
    assert edge[("c1", "relu")] == 2 * 8 * 8 * 8 * 4
    # parallel branches: c1 and c2 both read only the input; neither reaches the other
    assert "c2" not in _reachable(g, "c1") and "c1" not in _reachable(g, "c2")


def test_total_flops_equal_flop_counter(branchy):
    m, x, g = branchy
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        m(x)
    assert g.total_flops == pytest.approx(fc.get_total_flops(), rel=1e-9)


def test_run_node_by_node_equals_eager_with_structured_output(branchy):
    m, _, g = branchy
    x = torch.randn(2, 3, 8, 8)  # fresh inputs, not the example ones
    out = g.source.run_node_by_node(x)
    with torch.no_grad():
        ref = m(x)
    assert torch.equal(out["out"], ref["out"]) and torch.equal(out["z"][0], ref["z"][0])
    assert out["z"][1] == 2


def test_compiled_ops_read_only_what_earlier_ops_wrote(branchy):
    _, x, g = branchy
    src = g.source
    ops = src.compile_ops()
    assert [c.op_id for c in ops] == [op.id for op in g.ops]
    assert all(isinstance(c, CompiledOp) for c in ops)
    available = set(src.input_slots) | set(src.const_slots)
    written: set[int] = set()
    for c in ops:
        assert set(c.reads) <= available, c.op_id
        assert not set(c.writes) & written, c.op_id
        written |= set(c.writes)
        available |= set(c.writes)
    values = src.new_values(x)
    assert values[src.input_slots[0]] is x
    for s, target in src.const_slots.items():
        assert values[s] is getattr(src.gm, target)
    # every slot the output needs is written by some op (or is an input)
    spec_slots = [s.index for s in torch.utils._pytree.tree_leaves(src.output_spec) if isinstance(s, Slot)]
    assert set(spec_slots) <= available


def test_random_topological_order_gives_the_same_result(branchy):
    m, x, g = branchy
    with torch.no_grad():
        ref = m(x)
    for seed in range(5):
        out = _random_topo_run(g.source, g, (x,), seed)
        assert torch.equal(out["out"], ref["out"])


class InPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        a = y * 2
        y.add_(1)
        b = y + 3
        return a + b


def test_in_place_ops_get_ordering_edges():
    m, x = InPlace(), torch.randn(4)
    g = from_torch(m, (x,))
    ids = {g.op(i).name.split(" ")[0]: i for i in g.index}
    mul, add_, add = ids["mul"], ids["add_"], ids["add"]
    assert add_ in _reachable(g, mul), "a reader before the in-place op must run before it"
    assert add in _reachable(g, add_), "a reader after the in-place op must run after it"
    for seed in range(5):
        assert torch.equal(_random_topo_run(g.source, g, (x,), seed), m(x))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), DataDependent())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + 1


def test_untraceable_module_names_the_problem_module_and_line():
    with pytest.raises(ModelImportError) as err:
        from_torch(Wrapper(), (torch.randn(3),))
    msg = str(err.value)
    assert "control flow" in msg
    assert "body.1 (DataDependent)" in msg
    assert "test_import_torch.py" in msg and "if x.sum() > 0" in msg


def test_inputs_that_do_not_fit_name_the_node():
    with pytest.raises(ModelImportError) as err:
        from_torch(nn.Sequential(nn.Linear(4, 5)), (torch.randn(3, 3),))
    assert "fx node '_0'" in str(err.value) and "in module 0 (Linear)" in str(err.value)
    assert "shapes cannot be multiplied" in str(err.value)


def test_bad_arguments_are_rejected():
    with pytest.raises(ModelImportError, match="nn.Module"):
        from_torch(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]
    with pytest.raises(ModelImportError, match="2 inputs"):
        from_torch(nn.Bilinear(2, 2, 2), (torch.randn(1, 2),))
    g = from_torch(nn.Linear(2, 2), torch.randn(1, 2))  # a lone tensor is accepted
    with pytest.raises(ModelImportError, match="expected 1 inputs"):
        g.source.new_values()
