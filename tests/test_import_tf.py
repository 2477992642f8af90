"""The TensorFlow importer: Keras applications and tf.functions become graphs of compute ops.

TensorFlow is slow to import and Keras models slow to build, so the models
are module-scoped fixtures shared by the tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from opsched.errors import ModelImportError
from opsched.graph import OpGraph

pytestmark = pytest.mark.tf

#: TF node types that are bookkeeping, never compute ops of an imported graph.
BOOKKEEPING = {"Const", "Identity", "IdentityN", "NoOp", "ReadVariableOp", "VarHandleOp", "Placeholder",
               "Shape", "ShapeN", "Size", "Rank", "Reshape", "Squeeze", "ExpandDims", "StopGradient"}


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def mobilenet(tf):
    from opsched.importers.tf_graph import from_keras

    model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3))
    return from_keras(model)


@pytest.fixture(scope="module")
def inception(tf):
    from opsched.importers.tf_graph import from_keras

    model = tf.keras.applications.InceptionV3(weights=None, input_shape=(75, 75, 3))
    return from_keras(model, batch=2)


def test_mobilenet_v2_flops_match_the_published_count(mobilenet):
    # MobileNetV2 1.0 at 224x224: 300M multiply-adds (Sandler et al., 2018, table 4)
    # = 0.6 GFLOPs for convolutions and the classifier; elementwise ops add ~3%.
    conv_mm = sum(op.flops for op in mobilenet.ops if op.kind in ("conv", "matmul"))
    assert 0.57e9 < conv_mm < 0.63e9
    assert 0.58e9 < mobilenet.total_flops < 0.66e9
    # Weights: 3.5M parameters (float32); BN scales folded into the filters keep the count.
    params = sum(op.param_bytes for op in mobilenet.ops)
    assert 3.3e6 * 4 < params < 3.7e6 * 4


def test_first_conv_flops_follow_the_formula(mobilenet):
    conv1 = next(op for op in mobilenet.ops if op.kind == "conv")
    # 224 -> 112 (stride 2), 3x3x3 -> 32 channels: 2 * N*Ho*Wo*Co * Kh*Kw*Ci.
    assert conv1.shape == (1, 112, 112, 32)
    assert conv1.flops == 2 * 112 * 112 * 32 * 3 * 3 * 3
    assert conv1.param_bytes == 3 * 3 * 3 * 32 * 4
    assert conv1.bytes_written == 112 * 112 * 32 * 4
    assert conv1.dtype == "float32"


def test_graph_holds_compute_ops_only(mobilenet, inception):
    for g in (mobilenet, inception):
        types = set(g.meta["tf_op_types"])
        assert not types & BOOKKEEPING, f"{g.name}: bookkeeping left: {types & BOOKKEEPING}"
        assert {op.kind for op in g.ops} >= {"conv", "matmul", "elementwise", "reduce"}
        # Every TF op type maps to a canonical kind; only padding is "other".
        assert sum(op.kind == "other" for op in g.ops) == g.meta["tf_op_types"].get("Pad", 0)
        assert len(g.sources) == 1  # everything hangs off the one input
        assert g.meta["removed_nodes"]["Const"] > 0


def test_depthwise_conv_counts_one_input_channel_per_output(mobilenet):
    dw = [op for op in mobilenet.ops if "depthwise" in op.id and op.kind == "conv"]
    assert len(dw) == 17
    first = dw[0]
    n, h, w, c = first.shape
    assert first.flops == 2 * n * h * w * c * 3 * 3


def test_inception_branches_are_parallel_paths(inception):
    assert inception.width() >= 4
    concats = [op for op in inception.ops if op.kind == "concat_split"]
    assert len(concats) == 11
    # mixed0 joins four branches that no path connects.
    first = min(concats, key=lambda op: inception.levels[inception.index[op.id]])
    assert len(inception.predecessors(first.id)) == 4
    assert inception.op(inception.ops[0].id).shape[0] == 2  # batch=2 propagated


def test_edges_carry_tensor_bytes_and_json_round_trips(inception, tmp_path):
    for e in inception.edges:
        src = inception.op(e.src)
        assert e.bytes == pytest.approx(np.prod(src.shape) * 4)
    path = tmp_path / "inception.json"
    inception.save(path)
    back = OpGraph.load(path)
    assert back == inception and back.fingerprint() == inception.fingerprint()


def test_source_is_a_self_contained_graph_def(mobilenet, tf):
    src = mobilenet.source
    gd = src.graph_def_proto()
    names = {n.name for n in gd.node}
    assert {op.id for op in mobilenet.ops} <= names
    assert not any(n.op in ("VarHandleOp", "ReadVariableOp") for n in gd.node)
    assert src.inputs[0].shape == (1, 224, 224, 3)
    (x,) = src.random_inputs(0)
    assert x.shape == (1, 224, 224, 3) and x.dtype == np.float32
    assert src.keras_config and "mobilenetv2" in src.keras_config.lower()


def test_tf_function_flops_bytes_and_views(tf):
    from opsched.importers.tf_graph import from_tf_function

    rng = np.random.default_rng(0)
    filt = tf.constant(rng.standard_normal((3, 3, 4, 8)).astype(np.float32))
    dw = tf.constant(rng.standard_normal((3, 3, 8, 2)).astype(np.float32))
    v = tf.Variable(rng.standard_normal((16 * 8, 10)).astype(np.float32))

    def fn(x):
        y = tf.nn.relu(tf.nn.conv2d(x, filt, 1, "SAME"))
        z = tf.nn.depthwise_conv2d(y, dw, [1, 2, 2, 1], "VALID")  # 8x8 -> 3x3, 16 channels
        p = tf.nn.max_pool2d(y, 2, 2, "VALID")  # a parallel branch: 4x4x8
        f = tf.reshape(p, [2, -1])  # a view: looked through
        return tf.matmul(f, v), tf.reduce_mean(z, axis=[1, 2])

    g = from_tf_function(fn, [tf.TensorSpec((2, 8, 8, 4), tf.float32)], name="tiny")
    kinds = {op.kind for op in g.ops}
    assert kinds == {"conv", "elementwise", "pool", "matmul", "reduce"}
    by_kind = {}
    for op in g.ops:
        by_kind.setdefault(op.kind, []).append(op)
    conv, dwc = sorted(by_kind["conv"], key=lambda op: -op.flops)
    assert conv.flops == 2 * 2 * 8 * 8 * 8 * 3 * 3 * 4
    assert dwc.shape == (2, 3, 3, 16) and dwc.flops == 2 * 2 * 3 * 3 * 16 * 3 * 3
    (mm,) = by_kind["matmul"]
    assert mm.flops == 2 * 2 * 10 * 128
    assert mm.param_bytes == 128 * 10 * 4  # the variable was frozen into a constant
    (pool,) = by_kind["pool"]
    assert pool.flops == 2 * 4 * 4 * 8 * 4
    assert g.predecessors(mm.id) == [pool.id]  # through the Reshape
    (relu,) = by_kind["elementwise"]
    assert set(g.successors(relu.id)) == {dwc.id, pool.id}
    assert g.width() == 2
    assert "Reshape" not in g.meta["tf_op_types"] and g.meta["removed_nodes"].get("Reshape") == 1
    edge = next(e for e in g.edges if e.src == conv.id)
    assert edge.bytes == 2 * 8 * 8 * 8 * 4


def test_bad_inputs_are_clear_errors(tf):
    from opsched.importers.tf_graph import from_keras, from_tf_function

    with pytest.raises(ModelImportError, match="fully defined"):
        from_tf_function(lambda x: x * 2.0, [tf.TensorSpec((None, 4), tf.float32)])
    with pytest.raises(ModelImportError, match="expected tf.TensorSpec"):
        from_tf_function(lambda x: x * 2.0, [np.zeros((2, 4))])
    with pytest.raises(ModelImportError, match="expected a built Keras model"):
        from_keras(object())
    with pytest.raises(ModelImportError, match="no compute op"):
        from_tf_function(lambda x: tf.constant(1.0) + 2.0, [tf.TensorSpec((2,), tf.float32)])


def test_multi_input_keras_model(tf):
    from opsched.importers.tf_graph import from_keras

    a = tf.keras.Input((6,))
    b = tf.keras.Input((6,))
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Concatenate()([a, b]))
    g = from_keras(tf.keras.Model([a, b], out), batch=4)
    assert len(g.source.inputs) == 2 and all(t.shape == (4, 6) for t in g.source.inputs)
    mm = next(op for op in g.ops if op.kind == "matmul")
    assert mm.flops == 2 * 4 * 3 * 12
