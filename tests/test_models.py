"""Model specs (load_graph / load_model) and the `opsched graphs` command."""

from __future__ import annotations

import textwrap

import pytest
import torch
from typer.testing import CliRunner

from opsched.cli import app
from opsched.errors import GraphError, ModelImportError, OpschedError
from opsched.graph import OpGraph
from opsched.specs import load_graph, load_torch_model
from opsched.synthetic import generate


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


USER_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    from helper import HIDDEN  # a sibling module next to this file


    def make(batch, width=1.0):
        h = int(HIDDEN * width)
        model = nn.Sequential(nn.Linear(8, h), nn.ReLU(), nn.Linear(h, 2))
        return model, (torch.randn(batch, 8),)


    def not_a_model(batch):
        return 42
    """
)


@pytest.fixture
def user_file(tmp_path):
    (tmp_path / "helper.py").write_text("HIDDEN = 16\n")
    path = tmp_path / "mymodel.py"
    path.write_text(USER_MODEL)
    return path


def test_zoo_spec_and_bare_name():
    g = load_graph("zoo:lstm", batch=2, width=0.25)
    assert g.name == "lstm" and g.source is not None
    assert g.ops[0].shape[0] == 2
    assert load_graph("lstm", width=0.25).fingerprint() == load_graph("zoo:lstm", width=0.25).fingerprint()
    module, inputs = load_torch_model("zoo:transformer", batch=1, width=0.25)
    assert not module.training and inputs[0].dtype == torch.int64


def test_synthetic_spec_with_options():
    g = load_graph("synthetic:layered:n=50:seed=3")
    assert g == generate("layered", 50, 3)
    assert load_graph("synthetic:watts_strogatz:n=30", seed=5) == generate("watts_strogatz", 30, 5)
    assert load_graph("synthetic:erdos_renyi:n=40:p=0.1").meta["p"] == 0.1
    with pytest.raises(GraphError, match="not key=value"):
        load_graph("synthetic:layered:50")
    with pytest.raises(GraphError, match="not a number"):
        load_graph("synthetic:layered:n=many")
    with pytest.raises(GraphError, match="watts_strogatz"):
        load_graph("synthetic:ring")


def test_json_spec_round_trips(tmp_path):
    g = generate("erdos_renyi", 40, 1)
    g.save(tmp_path / "g.json")
    assert load_graph(str(tmp_path / "g.json")) == g
    with pytest.raises(GraphError, match="no such graph file"):
        load_graph(str(tmp_path / "missing.json"))


def test_user_python_factory(user_file):
    module, inputs = load_torch_model(f"{user_file}:make", batch=3, width=2.0)
    assert module[0].out_features == 32 and inputs[0].shape == (3, 8)
    g = load_graph(f"{user_file}:make", batch=3)
    assert g.name == "make" and [op.kind for op in g.ops] == ["matmul", "elementwise", "matmul"]
    x = torch.randn(3, 8)
    assert g.source.run_node_by_node(x).shape == (3, 2)


def test_user_python_errors_are_clear(user_file, tmp_path):
    with pytest.raises(ModelImportError, match="no such file"):
        load_graph(f"{tmp_path / 'nope.py'}:make")
    with pytest.raises(ModelImportError, match=r"no function 'build'.*make, not_a_model"):
        load_graph(f"{user_file}:build")
    with pytest.raises(ModelImportError, match="must return"):
        load_graph(f"{user_file}:not_a_model")
    with pytest.raises(ModelImportError, match="name the factory"):
        load_graph(str(user_file))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ModelImportError, match="boom"):
        load_graph(f"{broken}:make")


def test_unknown_spec_lists_what_exists():
    with pytest.raises(OpschedError) as err:
        load_graph("vgg16")
    for known in ("zoo:NAME", "inception", "randwire", "layered"):
        assert known in str(err.value)
    with pytest.raises(ModelImportError, match="not a torch model"):
        load_torch_model("synthetic:layered")
    with pytest.raises(ModelImportError, match="the zoo has"):
        load_graph("zoo:vgg16")


def test_graphs_command_prints_the_table_and_saves(tmp_path):
    runner = CliRunner()
    out = tmp_path / "graphs"
    result = runner.invoke(app, ["graphs", "lstm", "transformer", "--width", "0.25", "--synthetic",
                                 "--n", "30", "--save", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("lstm", "transformer", "layered-30-s0", "erdos_renyi-30-s0", "GFLOPs", "width", "depth"):
        assert text in result.output
    saved = sorted(p.name for p in out.glob("*.json"))
    from opsched.synthetic import FAMILIES

    assert len(saved) == 2 + len(FAMILIES) and "lstm.json" in saved
    g = OpGraph.load(out / "lstm.json")
    assert str(len(g.ops)) in result.output
    assert OpGraph.load(out / "layered-30-s0.json") == generate("layered", 30, 0)


def test_graphs_command_rejects_unknown_model():
    result = CliRunner().invoke(app, ["graphs", "vgg"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ModelImportError) and "inception" in str(result.exception)
