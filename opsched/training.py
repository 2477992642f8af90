"""``opsched.train_step(policy, module, loss_fn, optimizer, example_x, example_y)``: a training step under a schedule.

    step = opsched.train_step(None, model, F.cross_entropy, optimizer, x0, y0)   # None: the shipped policy
    for x, y in loader:
        loss = step(x, y)          # what zero_grad / forward / loss / backward / optimizer.step() do

The training step is a mode of the one apply pipeline (:mod:`opsched.scheduled`,
adapter :mod:`opsched.adapters.train`): the step - forward, loss, backward and
the optimizer's update, every parameter's update its own op - is captured as
one graph, the policy plans it with this machine's planning model, the
shortlist of candidate plans is timed here, one scheduled step is checked
against one eager step from the same state (on copies), and the result is a
:class:`~opsched.adapters.train.TrainStep`.  Calls with another shape, or
after the module's modes, parameters, hooks or optimizer options changed, run
the eager step with a ``ScheduleFallbackWarning`` saying why.

The optimizer is the user's ``torch.optim`` object (SGD with momentum,
Adam, AdamW; its ``lr`` is read every call, so LR schedulers work); its state
and the module's parameters and buffers are updated in place of eager's
update, so ``state_dict()`` and ``optimizer.state_dict()`` are those of eager
training.  ``p.grad`` is not filled in.  ONNX Runtime has no maintained CPU
training from pip (onnxruntime-training stopped at 1.19.2), so training
steps run on PyTorch's kernels: ``torch-cpu`` (or ``torch-cuda``).

A Keras model with a Keras loss (``loss(y_true, y_pred)``) and a Keras
optimizer is a :class:`~opsched.adapters.keras_train.KerasTrainingNetwork`:
its step runs on TensorFlow (``tf``), ``step.fit(x, y, epochs=...,
batch_size=...)`` is its ``model.fit``, and the trained weights come back into
the model on ``step.sync()`` and at the end of ``fit`` (the sync rule:
:mod:`opsched.adapters.keras_train`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opsched.engine.contracts import Backend, PerfModel
from opsched.machine import Machine
from opsched.measured import DEFAULT_TOP
from opsched.policies.base import Policy


def train_step(policy: Policy | str | Path | None, module: Any, loss_fn: Any, optimizer: Any, example_x: Any,
               example_y: Any, *, backend: str | Backend = "auto", machine: Machine | str | None = None,
               perf_model: PerfModel | str = "auto", verify: bool = True, measure: int = DEFAULT_TOP) -> Any:
    """Capture, plan, time, check and return the training step (see the module docstring).

    ``example_x`` is a tensor or a tuple of tensors (the module's positional
    inputs); ``example_y`` what ``loss_fn(module(*x), y)`` takes.  Other
    arguments as :func:`opsched.apply`.  Never raises for a step it cannot
    schedule: the result then runs the eager step (``.fallback`` says why)."""
    from opsched.adapters.train import TrainingNetwork
    from opsched.scheduled import apply
    from opsched.specs import is_keras

    if is_keras(module):  # a Keras model: loss(y_true, y_pred) and a Keras optimizer (opsched.adapters.keras_train)
        from opsched.adapters.keras_train import KerasTrainingNetwork

        net: Any = KerasTrainingNetwork(module, loss_fn, optimizer)
    else:
        net = TrainingNetwork(module, loss_fn, optimizer)
    return apply(policy, net, (example_x, example_y), backend=backend, machine=machine, perf_model=perf_model,
                 verify=verify, measure=measure)




def load_training(spec: str, batch: int = 4, width: float = 1.0, seed: int = 0, optimizer: str = "sgd",
                  lr: float | None = None) -> tuple[Any, Any, Any]:
    """A training step a spec names: ``(TrainingNetwork, example_x, example_y)``.

    ``zoo:NAME[@BxW]``: the zoo model in train mode with its default loss and
    random targets (:func:`opsched.zoo.training.build_train`; BatchNorm models
    need batch >= 2).  ``keras:NAME[:side=N]``: the ``keras.applications``
    model (``weights=None``) with sparse categorical cross-entropy on random
    labels (:func:`opsched.adapters.keras_train.keras_application_step`).
    ``path/to/module.py:factory``: ``factory(batch)`` returns ``(module,
    example_x, example_y, loss_fn)`` - a torch module and ``loss_fn(out, y)``,
    or a Keras model and a Keras loss ``loss_fn(y_true, y_pred)`` (then a
    :class:`~opsched.adapters.keras_train.KerasTrainingNetwork`).  ``optimizer``:
    ``sgd``, ``adam`` or ``adamw`` (:func:`opsched.adapters.train.make_optimizer`,
    :func:`opsched.adapters.keras_train.make_keras_optimizer`)."""
    from opsched.adapters.train import TrainingNetwork, make_optimizer
    from opsched.errors import ModelImportError
    from opsched.specs import _load_py_factory, _split_py, _zoo_size, is_keras
    from opsched.zoo import ZOO
    from opsched.zoo.training import build_train

    spec = spec.strip()
    if spec.startswith("keras:"):  # a keras.applications model (opsched.adapters.keras_train)
        from opsched.adapters.keras_train import keras_application_step

        return keras_application_step(spec, batch, width, seed, optimizer, lr)
    if spec.startswith("zoo:") or spec in ZOO:
        name, b, w = _zoo_size(spec if spec.startswith("zoo:") else f"zoo:{spec}", batch, width)
        ex = build_train(name, b, w, seed)
        module, x, y, loss_fn = ex.module, ex.inputs, ex.targets, ex.loss_fn
    else:
        py = _split_py(spec)
        if py is None:
            raise ModelImportError(f"train mode: model spec {spec!r} is not a zoo model, a keras: model or a "
                                   "module.py:factory; ONNX training steps are not scheduled (see the README)")
        fn = _load_py_factory(*py)
        try:
            result = fn(batch)
        except Exception as exc:
            raise ModelImportError(f"{spec}(batch={batch}) raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(result, tuple) and len(result) == 4 and callable(result[3])):
            raise ModelImportError(f"{spec}: in train mode factory(batch) must return (module, example_x, example_y, "
                                   f"loss_fn), got {type(result).__name__}"
                                   + (f" of {len(result)}" if isinstance(result, tuple) else ""))
        module, x, y, loss_fn = result
        if is_keras(module):  # a Keras model: loss_fn(y_true, y_pred), a Keras optimizer
            from opsched.adapters.keras_train import KerasTrainingNetwork, make_keras_optimizer

            return KerasTrainingNetwork(module, loss_fn, make_keras_optimizer(optimizer, lr)), x, y
        module.train()
    return TrainingNetwork(module, loss_fn, make_optimizer(optimizer, module, lr)), x, y


__all__ = ["load_training", "train_step"]
