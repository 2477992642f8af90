"""Keras training steps (issue 22): the capture, the step run in a TensorFlow worker under a plan,
equality with Keras's own training (``model.fit`` and a hand-written eager GradientTape loop), where
the weights are (the sync rule), the fit path, the fallbacks, and ``opsched apply --mode train``.

Small models on 8x8 inputs, batch 4; one TFBackend for the module (its workers are reused).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

import opsched.commands.apply  # noqa: F401  (registers the command)
from opsched.adapters.base import ScheduleFallbackWarning
from opsched.cli import app

pytestmark = pytest.mark.tf

STEPS = 6
BATCH = 4

FACTORY = '''
import keras
import numpy as np


def build(batch):
    keras.utils.set_random_seed(1)
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    y = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(x, y, name="tinytrain")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((batch, 8, 8, 3)).astype(np.float32)
    ys = rng.integers(0, 3, size=(batch,)).astype(np.int64)
    return model, xs, ys, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
'''


@pytest.fixture(scope="module")
def keras():
    pytest.importorskip("tensorflow")
    import keras

    return keras


def build(keras, dropout: bool = False):
    """Two branches after a BatchNorm (so a plan can co-run ops), conv without bias before BN (a bias
    there gets a gradient of pure round-off, which Adam scales up to its learning rate)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    b = keras.layers.Conv2D(8, 1, activation="tanh")(h)
    h = keras.layers.Concatenate()([a, b])
    if dropout:
        h = keras.layers.Dropout(0.25)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    y = keras.layers.Dense(5, kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    return keras.Model(x, y, name="twobranch")


def optimizer(keras, kind: str):
    return {"sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(1e-2),
            "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05)}[kind]()


def data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 8, 8, 3)).astype(np.float32), rng.integers(0, 5, size=(n,)).astype(np.int64)


def loss_fn(keras):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def close(a, b) -> bool:
    return all(np.allclose(u, v, rtol=1e-4, atol=1e-6) for u, v in zip(a, b))


def eager_gradient_tape(model, loss, opt, x, y) -> float:
    """The hand-written eager step (no tf.function)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True)) + tf.add_n(model.losses)
    grads = tape.gradient(value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return float(value)


@pytest.fixture(scope="module")
def machine():
    from opsched.machine import get_machine

    return get_machine("local").cpu_only()


@pytest.fixture(scope="module")
def shared(keras, machine):
    from opsched.backends.tf_cpu import TFBackend

    be = TFBackend(machine, warmup=0, repeats=1, trace_runs=1)
    yield be
    be.close()
    assert not be.worker_pids()


@pytest.fixture
def use_shared(shared, monkeypatch):
    import opsched.scheduled

    monkeypatch.setattr(opsched.scheduled, "shared_backend", lambda name, machine: shared)
    return shared


# ------------------------------------------------------------------ capture
def test_capture_phases_and_resource_variables(keras):
    from opsched.importers.tf_step import OPTIMIZER, STATE, TRAINABLE, TFStepSource, capture_keras_step
    from opsched.phases import check_phases, phase_counts

    model, opt = build(keras), optimizer(keras, "adamw")
    x, y = data(BATCH)
    cap = capture_keras_step(model, loss_fn(keras), opt, x, y)
    g, src = cap.graph, cap.source
    check_phases(g)  # every op has a phase, no edge goes back to an earlier one
    counts = phase_counts(g)
    assert all(counts[p] > 0 for p in ("forward", "backward", "update")), counts
    phases = g.meta["phases"]
    types = {n.name: n.op for n in src.graph_def_proto().node}
    for op in g.ops:
        t = types[op.id]
        assert t not in ("Const", "ReadVariableOp", "Identity", "Placeholder", "NoOp")  # bookkeeping looked through
        if op.id.startswith("gradient_tape/") or t.endswith(("BackpropFilter", "BackpropInput", "Grad")):
            assert phases[op.id] == "backward", op.id
        if op.id.startswith(f"{opt.name}/"):
            assert phases[op.id] == "update", op.id
        if t == "Conv2D" and not op.id.startswith("gradient_tape/"):
            assert phases[op.id] == "forward", op.id
    # BatchNorm's moving statistics are written in the forward, every trainable variable in the update
    writes = {op.id: phases[op.id] for op in g.ops if types[op.id].startswith("Assign")}
    assert any(p == "forward" for p in writes.values()) and any(p == "update" for p in writes.values())
    # AdamW's decay is not under the optimizer's scope in every Keras version: its ops are updates anyway
    assert all(p == "update" for k, p in writes.items() if "moving" not in k and "batch_normalization" not in k)
    # variables stay resources: one placeholder per variable, none frozen into a constant
    assert isinstance(src, TFStepSource) and len(src.variables) == len(cap.variables) == len(src.initial)
    roles = {v.role for v in src.variables}
    assert {TRAINABLE, STATE, OPTIMIZER} <= roles
    assert sum(v.role == TRAINABLE for v in src.variables) == len(model.trainable_variables)
    resource_ph = {n.name for n in src.graph_def_proto().node if n.op == "Placeholder"
                   and n.attr["dtype"].type == 20}  # DT_RESOURCE
    assert {v.node for v in src.variables} == resource_ph
    biggest_const = max((len(n.attr["value"].tensor.tensor_content) for n in src.graph_def_proto().node
                         if n.op == "Const"), default=0)
    assert biggest_const < min(v.nbytes for v in src.variables if v.role == TRAINABLE and v.nbytes > 64)
    assert any(v.written for v in src.variables) and not all(v.written for v in src.variables)  # lr is read-only


def test_capture_refuses_what_it_cannot_schedule(keras):
    from opsched.errors import ModelImportError
    from opsched.importers.tf_step import capture_keras_step

    x, y = data(BATCH)
    with pytest.raises(ModelImportError, match="expected a Keras optimizer"):
        capture_keras_step(build(keras), loss_fn(keras), "sgd", x, y)
    with pytest.raises(ModelImportError, match="unknown Keras loss 'no_such_loss'"):
        capture_keras_step(build(keras), "no_such_loss", optimizer(keras, "sgd"), x, y)
    sub = keras.Sequential([keras.layers.Dense(3)])  # never built
    with pytest.raises(ModelImportError, match="is not built"):
        capture_keras_step(sub, loss_fn(keras), optimizer(keras, "sgd"), x, y)


# ---------------------------------------------------------------- runtime
def test_worker_states_are_separate_and_timing_trains_scratch(keras, shared, machine):
    from opsched.backends import tf_train
    from opsched.importers.tf_step import capture_keras_step
    from opsched.plan import uniform_plan

    x, y = data(BATCH)
    cap = capture_keras_step(build(keras), loss_fn(keras), optimizer(keras, "sgd"), x, y)
    g = cap.graph
    plan = uniform_plan(g, machine, 1)
    settings = tf_train.plan_args(shared, g, plan).settings
    start = cap.read()
    tf_train.push(shared, g, settings, "a", start)
    back = tf_train.pull(shared, g, settings, "a")
    assert all(u.shape == v.shape and u.dtype == v.dtype and np.array_equal(u, v) for u, v in zip(back, start))
    loss = tf_train.step(shared, g, plan, "a", [x, y])
    after = tf_train.pull(shared, g, settings, "a")
    assert not close(after, start) and np.isfinite(loss)
    assert shared.time_plan(g, plan, repeats=3, warmup=1, inputs=[x, y])  # trains "scratch", not "a"
    assert all(np.array_equal(u, v) for u, v in zip(tf_train.pull(shared, g, settings, "a"), after))
    tf_train.drop(shared, g, settings, "a")
    trace = shared.run(g, plan, [x, y])  # a traced step: one event per op
    assert {e.op for e in trace.events} == {op.id for op in g.ops}


# ------------------------------------------------------------- equality
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_train_step_equals_model_fit_and_eager_gradient_tape(keras, use_shared, kind):
    import opsched

    X, Y = data(STEPS * BATCH, seed=3)
    ours, fit_model, tape_model = build(keras), build(keras), build(keras)
    loss = loss_fn(keras)
    opt = optimizer(keras, kind)
    step = opsched.train_step("critical-path-first", ours, loss, opt, X[:BATCH], Y[:BATCH], measure=0)
    assert step.scheduled and step.fallback is None, step.fallback_reason
    start = [w.copy() for w in ours.get_weights()]
    losses = [float(step(X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH])) for i in range(STEPS)]
    # the sync rule: trained in the worker, copied back on sync()
    assert all(np.array_equal(a, b) for a, b in zip(ours.get_weights(), start))
    assert step.sync() > 0 and step.sync() == 0.0  # a second sync has nothing to copy
    assert int(opt.iterations.numpy()) == STEPS

    fit_opt = optimizer(keras, kind)
    fit_model.compile(optimizer=fit_opt, loss=loss)
    hist = fit_model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert close(ours.get_weights(), fit_model.get_weights())  # weights and BatchNorm statistics
    assert close([v.numpy() for v in opt.variables], [v.numpy() for v in fit_opt.variables])  # slots, iterations
    assert np.isclose(np.mean(losses), hist.history["loss"][0], rtol=1e-4)

    tape_opt = optimizer(keras, kind)
    curve = [eager_gradient_tape(tape_model, loss, tape_opt, X[i * BATCH:(i + 1) * BATCH],
                                 Y[i * BATCH:(i + 1) * BATCH]) for i in range(STEPS)]
    assert np.allclose(losses, curve, rtol=1e-4)  # equal loss curves
    assert close(ours.get_weights(), tape_model.get_weights())


def test_the_user_model_holds_weights_through_model_property_and_sync_every(keras, use_shared):
    import opsched
    from opsched.adapters.keras_train import KerasTrainingNetwork

    X, Y = data(3 * BATCH, seed=5)
    ours, ref = build(keras, dropout=True), build(keras, dropout=True)
    step = opsched.train_step(None, ours, loss_fn(keras), optimizer(keras, "sgd"), X[:BATCH], Y[:BATCH])
    assert step.scheduled, step.fallback_reason
    assert any(m.startswith("tf-order:") for m in step.plan.meta["measured"])  # TF's own order was timed too
    fn = KerasTrainingNetwork(ref, loss_fn(keras), optimizer(keras, "sgd")).function()
    step.sync_every = 2
    for i in range(3):
        b = slice(i * BATCH, (i + 1) * BATCH)
        got, want = float(step(X[b], Y[b])), float(fn(X[b], Y[b]))
        assert np.isclose(got, want, rtol=1e-4)  # Dropout draws Keras's numbers (its seed is a variable)
        if i == 1:  # synced after the second call by itself
            assert close(ours.get_weights(), ref.get_weights())
    assert close(step.model.get_weights(), ref.get_weights())  # .model syncs
    assert step.sync_stats["pulls"] == 2 and step.sync_stats["pull_bytes"] > 0


# --------------------------------------------------------------------- fit
def test_fit_path_matches_model_fit(keras, use_shared):
    import opsched

    X, Y = data(10, seed=7)  # 2 full batches and one of 2: that one runs Keras's own step
    ours, ref = build(keras), build(keras)
    step = opsched.train_step("critical-path-first", ours, loss_fn(keras), optimizer(keras, "adam"), X[:BATCH],
                              Y[:BATCH], measure=0)
    ref.compile(optimizer=optimizer(keras, "adam"), loss=loss_fn(keras))
    with pytest.warns(ScheduleFallbackWarning, match="differ from the planned"):
        hist = step.fit(X, Y, epochs=2, batch_size=BATCH, shuffle=False)
    want = ref.fit(X, Y, epochs=2, batch_size=BATCH, shuffle=False, verbose=0)
    assert hist.epoch == [0, 1] and np.allclose(hist.history["loss"], want.history["loss"], rtol=1e-4)
    assert close(ours.get_weights(), ref.get_weights())  # fit syncs at the end


# --------------------------------------------------------------- fallbacks
def test_other_shapes_and_lr_changes(keras, use_shared):
    import opsched
    from opsched.adapters.keras_train import KerasTrainingNetwork

    X, Y = data(4 * BATCH, seed=9)
    ours, ref = build(keras), build(keras)
    opt, ref_opt = optimizer(keras, "sgd"), optimizer(keras, "sgd")
    step = opsched.train_step("critical-path-first", ours, loss_fn(keras), opt, X[:BATCH], Y[:BATCH], measure=0)
    fn = KerasTrainingNetwork(ref, loss_fn(keras), ref_opt).function()
    seq = [(X[:4], Y[:4]), (X[4:6], Y[4:6]), (X[6:10], Y[6:10]), (X[10:14], Y[10:14])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (bx, by) in enumerate(seq):
            if i == 2:  # the learning rate changed between calls: the worker sees it
                opt.learning_rate = 0.01
                ref_opt.learning_rate = 0.01
            assert np.isclose(float(step(bx, by)), float(fn(bx, by)), rtol=1e-4), i
    msgs = [str(w.message) for w in caught if issubclass(w.category, ScheduleFallbackWarning)]
    assert len(msgs) == 1 and "float32[2, 8, 8, 3]" in msgs[0] and "differ from the planned" in msgs[0]
    assert step.scheduled  # one call with another shape falls back; the step stays scheduled
    step.sync()
    assert close(ours.get_weights(), ref.get_weights())


def test_a_step_that_cannot_be_captured_falls_back_with_a_reason(keras, use_shared):
    import opsched

    x, y = data(BATCH)
    model = build(keras)
    with pytest.warns(ScheduleFallbackWarning, match="cannot import the model"):
        step = opsched.train_step(None, model, "no_such_loss", optimizer(keras, "sgd"), x, y)
    assert not step.scheduled and step.fallback.reason.value == "import"


# ------------------------------------------------------------------- apply
def test_cli_apply_mode_train_keras_factory(keras, use_shared, tmp_path):
    path = tmp_path / "tinytrain.py"
    path.write_text(FACTORY)
    out = tmp_path / "apply.json"
    res = CliRunner().invoke(app, ["apply", "--mode", "train", "--model", f"{path}:build", "--batch", "4",
                                   "--repeats", "2", "--warmup", "0", "--measure", "0", "--json", str(out)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    data_ = json.loads(out.read_text())
    assert data_["mode"] == "train" and data_["framework"] == "keras-train" and data_["backend"] == "tf"
    assert [r["config"] for r in data_["rows"]][:3] == ["tf-default", "tf-recommended", "critical-path-first"]
    assert all(r["outputs_equal_eager"] and r["median_s"] > 0 for r in data_["rows"]), data_["rows"]
    assert not data_["fallbacks"], data_["fallbacks"]


def test_load_training_keras_spec(keras):
    from opsched.adapters.keras_train import KerasTrainingNetwork
    from opsched.training import load_training

    net, x, y = load_training("keras:MobileNetV2:side=32", batch=2, width=0.35, optimizer="adam")
    assert isinstance(net, KerasTrainingNetwork) and x.shape == (2, 32, 32, 3) and y.dtype == np.int64
    assert type(net.optimizer).__name__ == "Adam" and 0 <= y.min() and y.max() < 1000
