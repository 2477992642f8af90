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
               perf_model: PerfModel | str = "auto", verify: bool = True, measure: int = DEFAULT_TOP,
               memory_limit: float | None = None) -> Any:
    """Capture, plan, time, check and return the training step (see the module docstring).

    ``example_x`` is a tensor or a tuple of tensors (the module's positional
    inputs); ``example_y`` what ``loss_fn(module(*x), y)`` takes.  Other
    arguments as :func:`opsched.apply`.  Never raises for a step it cannot
    schedule: the result then runs the eager step (``.fallback`` says why)."""
    from opsched.scheduled import apply
    from opsched.specs import TrainingNetwork, is_keras

    if is_keras(module):  # a Keras model: loss(y_true, y_pred) and a Keras optimizer (opsched.adapters.keras_train)
        from opsched.specs import KerasTrainingNetwork

        net: Any = KerasTrainingNetwork(module, loss_fn, optimizer)
    else:
        net = TrainingNetwork(module, loss_fn, optimizer)
    return apply(policy, net, (example_x, example_y), backend=backend, machine=machine, perf_model=perf_model,
                 verify=verify, measure=measure, memory_limit=memory_limit)




from opsched.specs import load_training  # noqa: E402,F401 (re-exported)

__all__ = ["load_training", "train_step"]
