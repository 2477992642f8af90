"""One grammar for graphs, models and machines: every command, the training
config, ``gym.make`` and the benchmarks name them the same way.

Graph and model specs (:func:`load_graph`, :func:`load_model`):

==================================  ==========================================
``zoo:NAME[@BxW]``                  a built-in zoo model (``opsched graphs``), at
                                    batch B and width W when given (else the
                                    caller's ``batch`` / ``width``); a bare zoo
                                    name works too
``synthetic:FAMILY[:k=v...]``       a random DAG: ``synthetic:layered:n=100:seed=3``
                                    (``n`` ops, default 100; other options go to
                                    the family, e.g. ``p=0.1``)
``FAMILY:N:SEED[:k=v...]``          the same, short: ``layered:60:3``
``path/graph.json``                 a saved :class:`~opsched.graph.OpGraph`
``keras:NAME[:side=N]``             a ``keras.applications`` model (``weights=None``,
                                    weights drawn from ``seed``), e.g.
                                    ``keras:MobileNetV2`` or ``keras:ResNet50:side=128``;
                                    ``--width`` is the model's ``alpha`` where it has one
``path/to/module.py:factory``       your own model: ``factory(batch)`` returns
                                    ``(nn.Module, example_inputs)``, or a built
                                    Keras model (or ``(keras_model, inputs)``);
                                    it also gets ``width=`` / ``seed=`` if it
                                    accepts them
``path/to/model.onnx``              an ONNX model, run by ONNX Runtime (the ``ort``
                                    backend); ``batch`` fills a symbolic first
                                    input dimension
==================================  ==========================================

Machine specs (:func:`load_machine`): ``local`` (this machine, probed), a
preset, a YAML file, ``cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]``,
``random:SEED`` (a draw of the randomized training family), or
``hard:NAME:SEED`` (a machine of the hard families, :mod:`opsched.hard`).

Torch models (zoo and ``.py``) import through
:func:`opsched.importers.torch_fx.from_torch`, so their graphs carry an
executable ``TorchSource``; Keras models through
:func:`opsched.importers.tf_graph.from_keras` (a ``TFSource``); JSON and
synthetic graphs have none (simulation only).  TensorFlow is imported only for
Keras specs (or when a ``.py`` factory has imported it itself).

ONNX models import through :func:`opsched.importers.onnx_graph.from_onnx`:
the graph ONNX Runtime runs after its optimisations, with an executable
``OnnxSource``.  :func:`load_onnx_graph` gives that graph for a torch spec too
(the module exported with ``torch.onnx.export``, cached under
the per-user cache (:mod:`opsched.cache`) by model, size, seed and the sources that built it).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from opsched.errors import GraphError, ModelImportError, OpschedError
from opsched.graph import OpGraph
from opsched.machine import MACHINE_SPECS, Machine, get_machine

SPEC_KINDS = ("zoo:NAME[@B[xW]], train:zoo:NAME[@B[xW]][:sgd|:adam|:adamw] or train:keras:NAME[:side=N][@B] (its training step), keras:NAME[:side=N], synthetic:FAMILY[:n=N][:seed=S], FAMILY:N:SEED, "
              "a .json graph file, path/to/model.onnx, or path/to/module.py:factory")


@dataclass(frozen=True)
class LoadedModel:
    """A model a spec names, ready to import and run.

    ``framework`` is ``"torch"`` (``model`` an ``nn.Module`` in eval mode,
    ``inputs`` its example inputs) or ``"keras"`` (``model`` a built Keras
    model, ``inputs`` numpy arrays the factory gave, or ``None``: then the
    importer's deterministic random inputs are used), or ``"onnx"`` (``model``
    the ``.onnx`` file's path, ``inputs`` random numpy arrays of its input
    shapes).  ``name`` names the graph.
    """

    framework: str
    model: Any
    inputs: tuple | None
    name: str
    spec: str
    batch: int = 1


def _available() -> str:
    from opsched.synthetic import GENERATORS
    from opsched.zoo import ZOO

    return (f"expected {SPEC_KINDS}; zoo models: {', '.join(ZOO)}; keras: any keras.applications name; "
            f"synthetic families: {', '.join(GENERATORS)}")


def _parse_options(parts: list[str], spec: str) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise GraphError(f"model spec {spec!r}: option {part!r} is not key=value")
        try:
            num = float(val)
        except ValueError:
            raise GraphError(f"model spec {spec!r}: option {key}={val!r} is not a number") from None
        opts[key] = int(num) if num.is_integer() and "." not in val else num
    return opts


def _split_py(spec: str) -> tuple[Path, str] | None:
    path, colon, factory = spec.rpartition(":")
    if colon and path.endswith(".py"):
        return Path(path), factory
    if spec.endswith(".py"):
        raise ModelImportError(
            f"model spec {spec!r}: name the factory function too, as path/to/module.py:factory"
        )
    return None


def _load_py_factory(path: Path, factory: str) -> Any:
    """Import the user's file by path (not by module name) and return its factory."""
    if not path.is_file():
        raise ModelImportError(f"model spec: no such file {str(path)!r}")
    if not factory.isidentifier():
        raise ModelImportError(f"model spec {path}:{factory}: {factory!r} is not a function name")
    modname = "opsched_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise ModelImportError(f"model spec: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # let the file import its siblings
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelImportError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    fn = getattr(module, factory, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == modname and not n.startswith("_"))
        raise ModelImportError(
            f"{str(path)!r} has no function {factory!r}; functions defined there: {', '.join(found) or 'none'}"
        )
    return fn


def is_keras(obj: Any) -> bool:
    """A Keras model (Keras 3 or tf_keras), detected without importing TensorFlow."""
    roots = {"keras", "tf_keras"}
    return hasattr(obj, "inputs") and any(
        c.__module__.split(".")[0] in roots or c.__module__.startswith("tensorflow.python.keras")
        for c in type(obj).__mro__)


def _call_factory(fn: Any, where: str, batch: int, width: float, seed: int) -> tuple[str, Any, tuple | None]:
    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(fn).parameters
        for key, val in (("width", width), ("seed", seed)):
            if key in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kwargs[key] = val
    except (TypeError, ValueError):
        pass
    try:
        result = fn(batch, **kwargs)
    except Exception as exc:
        raise ModelImportError(f"{where}(batch={batch}) raised {type(exc).__name__}: {exc}") from exc
    pair = isinstance(result, tuple) and len(result) == 2
    if is_keras(result) or (pair and is_keras(result[0])):
        model, inputs = (result, None) if is_keras(result) else result
        if inputs is not None:
            import numpy as np

            inputs = tuple(np.asarray(a) for a in (inputs if isinstance(inputs, (list, tuple)) else (inputs,)))
        return "keras", model, inputs
    torch = sys.modules.get("torch")
    if not (pair and torch is not None and isinstance(result[0], torch.nn.Module)):
        raise ModelImportError(
            f"{where}(batch) must return (nn.Module, example_inputs) or a built Keras model, "
            f"got {type(result).__name__}"
        )
    module, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return "torch", module.eval(), tuple(inputs)


def _keras_application(spec: str, width: float, seed: int) -> Any:
    """``keras:NAME[:side=N]``: a ``keras.applications`` model with fresh weights from ``seed``."""
    from opsched.importers.tf_graph import _tf

    name, *parts = spec[len("keras:"):].split(":")
    opts = _parse_options(parts, spec)
    side = opts.pop("side", None)
    if opts:
        raise ModelImportError(f"model spec {spec!r}: unknown option(s) {', '.join(opts)}; keras specs take side=N")
    tf = _tf()
    apps = tf.keras.applications
    ctor = getattr(apps, name, None)
    if not name or not callable(ctor) or not name[0].isupper():
        known = sorted(n for n in dir(apps) if n[:1].isupper() and callable(getattr(apps, n)))
        raise ModelImportError(f"model spec {spec!r}: no keras.applications model {name!r}; "
                               f"known: {', '.join(known)}")
    kwargs: dict[str, Any] = {"weights": None}
    if side is not None:
        if not isinstance(side, int) or side < 32:
            raise ModelImportError(f"model spec {spec!r}: side must be an int >= 32, got {side!r}")
        kwargs["input_shape"] = (side, side, 3)
    if width != 1.0:
        if "alpha" not in inspect.signature(ctor).parameters:
            raise ModelImportError(f"model spec {spec!r}: {name} has no width multiplier (alpha); "
                                   f"--width must be 1, got {width}")
        kwargs["alpha"] = width
    tf.keras.backend.clear_session()  # layer-name counters restart: the same spec, the same op ids
    tf.keras.utils.set_random_seed(seed)
    try:
        return ctor(**kwargs)
    except Exception as exc:  # noqa: BLE001 - Keras raises ValueError/TypeError for bad shapes
        raise ModelImportError(f"model spec {spec!r}: keras.applications.{name}({kwargs}) failed: {exc}") from None


def load_machine(spec: str | Machine | None = None) -> Machine:
    """The machine a spec names: ``random:SEED`` (a draw of the randomized family
    the policy trains on, :mod:`opsched.machine_family`), ``hard:NAME:SEED``
    (:mod:`opsched.hard`), else
    :func:`opsched.machine.get_machine` (``local``, a preset, a YAML file,
    ``cpu:CORES:GFLOPS_PER_CORE:MEM_GBS[:SOCKETS]``)."""
    if isinstance(spec, str) and spec.startswith("random:"):
        from opsched.errors import MachineError
        from opsched.machine_family import random_machine

        try:
            seed = int(spec[len("random:"):])
        except ValueError:
            raise MachineError(f"machine spec {spec!r}: expected random:SEED with an integer seed") from None
        return random_machine(seed)
    if isinstance(spec, str) and spec.startswith("hard:"):  # the hard families' machines (issue 23)
        from opsched.hard import load_hard_machine

        return load_hard_machine(spec)
    return get_machine(spec)


def _zoo_size(spec: str, batch: int, width: float) -> tuple[str, int, float]:
    """``zoo:NAME[@B[xW]]`` -> (NAME, batch, width); the spec's size wins over the caller's
    (``@B`` alone keeps the caller's width, 1.0 by default)."""
    name, _, size = spec[len("zoo:"):].partition("@")
    if size:
        try:
            b, _, w = size.partition("x")
            batch, width = int(b), (float(w) if w else width)
        except ValueError:
            raise GraphError(f"graph spec {spec!r}: expected zoo:NAME@BATCH or zoo:NAME@BATCHxWIDTH, "
                             "e.g. zoo:resnet50@8x0.5") from None
        if batch < 1 or not width > 0:
            raise GraphError(f"graph spec {spec!r}: batch must be >= 1 and width > 0")
    return name, batch, width


def load_model(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0) -> LoadedModel:
    """The torch module or Keras model of a zoo, ``keras:`` or ``.py`` spec, with its framework."""
    from opsched.zoo import ZOO, get_zoo_model

    spec = spec.strip()
    if spec.startswith("zoo:"):
        name, batch, width = _zoo_size(spec, batch, width)
        module, inputs = get_zoo_model(name).build(batch, width, seed)
        return LoadedModel("torch", module, inputs, name, spec, batch)
    if spec in ZOO and not Path(spec).exists():
        module, inputs = ZOO[spec].build(batch, width, seed)
        return LoadedModel("torch", module, inputs, spec, spec, batch)
    if spec.startswith("keras:"):
        model = _keras_application(spec, width, seed)
        return LoadedModel("keras", model, None, spec[len("keras:"):].split(":")[0], spec, batch)
    if spec.endswith(".onnx"):
        from opsched.importers.onnx_graph import example_inputs

        path = Path(spec)
        if not path.is_file():
            raise ModelImportError(f"model spec {spec!r}: no such ONNX file")
        return LoadedModel("onnx", path, example_inputs(path, batch, seed), path.stem, spec, batch)
    py = _split_py(spec)
    if py is not None:
        path, factory = py
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # should the file import TensorFlow: no INFO flood
        fn = _load_py_factory(path, factory)
        if "tensorflow" in sys.modules:  # a Keras factory: fresh layer names for each load
            sys.modules["tensorflow"].keras.backend.clear_session()
        framework, model, inputs = _call_factory(fn, f"{path}:{factory}", batch, width, seed)
        return LoadedModel(framework, model, inputs, factory, spec, batch)
    raise ModelImportError(f"model spec {spec!r} is not a torch model or a Keras model; {_available()}")


# ------------------------------------------------------------ training steps
@dataclass
class TrainingNetwork:
    """What a training step is made of: the module, the loss and the optimizer."""

    module: Any  # torch.nn.Module
    loss_fn: Callable[[Any, Any], Any]
    optimizer: Any  # torch.optim.Optimizer


#: The optimizers a training step is written out for (``--optimizer``): the class name (the same in
#: ``torch.optim`` and ``keras.optimizers``) and the defaults, the learning rate as ``lr``.
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "sgd": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
}


def _optimizer_settings(kind: str, lr: float | None) -> tuple[str, dict[str, float]]:
    """The class name and keyword arguments of optimizer ``kind`` (``lr`` overrides the default)."""
    if kind not in OPTIMIZERS:
        raise OpschedError(f"unknown optimizer {kind!r}; choose from {', '.join(OPTIMIZERS)}")
    name, defaults = OPTIMIZERS[kind]
    return name, {**defaults, **({"lr": lr} if lr is not None else {})}


def make_optimizer(kind: str, module: Any, lr: float | None = None) -> Any:
    """``sgd`` (lr 0.01, momentum 0.9), ``adam`` (lr 1e-3) or ``adamw`` (lr 1e-3, weight decay 0.01), over
    ``module``'s parameters, ``foreach=False`` (the per-parameter formulas the step graph writes out)."""
    import torch

    name, kw = _optimizer_settings(kind, lr)
    return getattr(torch.optim, name)(module.parameters(), **kw, foreach=False)


def load_training(spec: str, batch: int = 4, width: float = 1.0, seed: int = 0, optimizer: str = "sgd",
                  lr: float | None = None) -> tuple[Any, Any, Any]:
    """A training step a spec names: ``(TrainingNetwork, example_x, example_y)``.

    ``zoo:NAME[@BxW]``: the zoo model in train mode with its default loss and
    random targets (:func:`opsched.zoo.training.build_train`; BatchNorm models
    need batch >= 2).  ``path/to/module.py:factory``: ``factory(batch)``
    returns ``(module, example_x, example_y, loss_fn)``.  ``optimizer``:
    ``sgd``, ``adam`` or ``adamw`` (:func:`opsched.adapters.train.make_optimizer`)."""
    from opsched.errors import ModelImportError
    from opsched.zoo import ZOO
    from opsched.zoo.training import build_train

    spec = spec.strip()
    if spec.startswith("keras:"):  # a keras.applications model, sparse categorical cross-entropy
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
            return KerasTrainingNetwork(module, loss_fn, make_keras_optimizer(optimizer, lr)), x, y
        module.train()
    return TrainingNetwork(module, loss_fn, make_optimizer(optimizer, module, lr)), x, y



@dataclass
class KerasTrainingNetwork:
    """What a Keras training step is made of: the model, the loss (``loss(y_true, y_pred)``, a
    ``keras.losses.Loss`` or a name) and the Keras optimizer."""

    model: Any
    loss: Any
    optimizer: Any
    _function: Any = dataclass_field(default=None, repr=False)

    def function(self) -> Any:
        """Keras's own step as a ``tf.function`` (``function(*x_leaves, y)``; retraces for new shapes)."""
        if self._function is None:
            import tensorflow as tf

            from opsched.importers.tf_step import make_step, resolve_loss

            if not getattr(self.optimizer, "built", False):
                self.optimizer.build(self.model.trainable_variables)
            self._function = tf.function(make_step(self.model, resolve_loss(self.loss), self.optimizer),
                                         autograph=False)
        return self._function


def make_keras_optimizer(kind: str, lr: float | None = None) -> Any:
    """``sgd`` (lr 0.01, momentum 0.9), ``adam`` (lr 1e-3) or ``adamw`` (lr 1e-3, weight decay 0.01):
    the Keras twins of :func:`make_optimizer`."""
    import keras

    name, kw = _optimizer_settings(kind, lr)
    kw["learning_rate"] = kw.pop("lr")
    return getattr(keras.optimizers, name)(**kw)


def keras_application_step(spec: str, batch: int, width: float = 1.0, seed: int = 0, optimizer: str = "sgd",
                           lr: float | None = None) -> tuple[KerasTrainingNetwork, Any, Any]:
    """``keras:NAME[:side=N]`` in train mode: the ``keras.applications`` model (``weights=None``, fresh
    weights from ``seed``), random inputs, random labels over its classes, sparse categorical
    cross-entropy, and the optimizer (:func:`make_keras_optimizer`)."""
    import keras
    import numpy as np


    model = _keras_application(spec, width, seed)
    shape = tuple(model.inputs[0].shape[1:])
    if any(d is None for d in shape):
        raise ModelImportError(f"model spec {spec!r}: input shape {shape} is not fixed; give side=N")
    classes = int(model.outputs[0].shape[-1])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=(batch,)).astype(np.int64)
    loss = keras.losses.SparseCategoricalCrossentropy()
    return KerasTrainingNetwork(model, loss, make_keras_optimizer(optimizer, lr)), x, y



def load_torch_model(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[Any, tuple]:
    """The torch module (eval mode) and example inputs of a zoo or ``.py`` spec."""
    loaded = load_model(spec, batch, width, seed)
    if loaded.framework != "torch":
        raise ModelImportError(f"model spec {spec!r} is a Keras model, not a PyTorch one; it runs on the "
                               "TensorFlow backend (--backend tf)")
    assert loaded.inputs is not None  # a torch spec always comes with its example inputs
    return loaded.model, loaded.inputs


def import_graph(loaded: LoadedModel) -> OpGraph:
    """The OpGraph of a loaded model, with its executable source (torch FX, a frozen TF GraphDef, or
    the graph ONNX Runtime runs)."""
    if loaded.framework == "onnx":
        from opsched.importers.onnx_graph import from_onnx

        return from_onnx(loaded.model, loaded.inputs, name=loaded.name)
    if loaded.framework == "keras":
        from opsched.importers.tf_graph import from_keras

        return from_keras(loaded.model, batch=loaded.batch, name=loaded.name)
    from opsched.importers.torch_fx import from_torch

    assert loaded.inputs is not None  # a torch spec always comes with its example inputs
    return from_torch(loaded.model, loaded.inputs, name=loaded.name)


def load_graph(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0, *,
               cache_dir: str | Path | None = None) -> OpGraph:
    """The OpGraph a spec names (see the module docstring for the grammar).

    Zoo and Keras graphs are traced from real models (seconds each); with
    ``cache_dir`` their JSON is kept there, keyed by the spec, the size and the
    importer sources, and reused -- such a graph carries no executable source
    (simulation only: training and evaluation in the simulator)."""
    from opsched.synthetic import GENERATORS as FAMILIES
    from opsched.synthetic import generate
    from opsched.zoo import ZOO

    if not isinstance(spec, str) or not spec.strip():
        raise GraphError(f"empty graph spec; {_available()}")
    spec = spec.strip()
    if spec.startswith("train:"):
        return _training_graph(spec, batch, width, seed, cache_dir)
    if spec.startswith("synthetic:"):
        family, *parts = spec[len("synthetic:"):].split(":")
        opts = _parse_options(parts, spec)
        n_ops = int(opts.pop("n", 100))
        s = int(opts.pop("seed", seed))
        return generate(family, n_ops, s, **opts)
    head, *parts = spec.split(":")
    if head in FAMILIES and len(parts) >= 2 and not Path(spec).exists():
        try:
            n_ops, s = int(parts[0]), int(parts[1])
        except ValueError:
            raise GraphError(f"graph spec {spec!r}: expected FAMILY:N_OPS:SEED[:KEY=VALUE...]") from None
        return generate(head, n_ops, s, **_parse_options(parts[2:], spec))
    if spec.endswith(".json"):
        return OpGraph.load(spec)
    if spec.endswith(".onnx"):
        return import_graph(load_model(spec, batch, width, seed))
    if spec.startswith(("zoo:", "keras:")) and cache_dir is not None:
        if spec.startswith("zoo:"):
            name, b, w = _zoo_size(spec, batch, width)
            ident = f"zoo:{name}@{b}x{w}:{seed}"
        else:
            ident = f"{spec}@{batch}x{width}:{seed}"
        key = hashlib.sha256(f"{ident}|{_importer_hash()}".encode()).hexdigest()[:20]
        path = Path(cache_dir) / f"{key}.json"
        if path.is_file():
            return OpGraph.load(path)
        graph = import_graph(load_model(spec, batch, width, seed))
        path.parent.mkdir(parents=True, exist_ok=True)
        graph.save(path)
        return graph
    if (spec.startswith(("zoo:", "keras:")) or (spec in ZOO and not Path(spec).exists())
            or _split_py(spec) is not None):
        return import_graph(load_model(spec, batch, width, seed))
    raise GraphError(f"unknown graph spec {spec!r}; {_available()}")


TRAIN_OPTIMIZERS = tuple(OPTIMIZERS)


def _training_graph(spec: str, batch: int, width: float, seed: int, cache_dir: str | Path | None) -> OpGraph:
    """``train:MODEL[:OPTIMIZER]``: the training step of a zoo or ``.py`` model (forward, loss,
    backward, the optimizer's update; :func:`opsched.training.load_training`) as one graph, cached
    as JSON under ``cache_dir`` like the zoo's (then simulation only)."""
    body = spec[len("train:"):]
    head, _, last = body.rpartition(":")
    optimizer = "sgd"
    if last in TRAIN_OPTIMIZERS and head:
        body, optimizer = head, last
    if body.startswith("keras:") and "@" in body:  # train:keras:NAME[:side=N]@B: the batch
        body, _, b = body.rpartition("@")
        if not b.isdigit() or int(b) < 1:
            raise GraphError(f"graph spec {spec!r}: the batch after '@' must be a positive integer, got {b!r}")
        batch = int(b)
    path = None
    if cache_dir is not None:
        ident = f"{body}|{optimizer}|{batch}x{width}:{seed}"
        key = hashlib.sha256(f"train|{ident}|{_importer_hash()}".encode()).hexdigest()[:20]
        path = Path(cache_dir) / f"train_{key}.json"
        if path.is_file():
            return OpGraph.load(path)
    net, x, y = load_training(body, batch, width, seed, optimizer=optimizer)
    if isinstance(net, KerasTrainingNetwork):  # a Keras step: TensorFlow's capture (importers.tf_step)
        from opsched.importers.tf_step import capture_keras_step

        graph = capture_keras_step(net.model, net.loss, net.optimizer, x, y, name=f"train:{body}").graph
    else:
        from opsched.importers.torch_step import capture_step

        graph = capture_step(net.module, net.loss_fn, net.optimizer, x, y, name=f"train:{body}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        graph.save(path)
    return graph


def load_onnx_graph(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0, *,
                    opt_level: str = "all", cache_dir: str | Path | None = None) -> OpGraph:
    """The graph ONNX Runtime runs for a model spec (the ``ort`` backend's graph):
    an ``.onnx`` file as it is, a torch model (zoo or ``.py``) exported with
    ``torch.onnx.export`` first - cached under ``cache_dir`` (default
    the per-user cache's ``onnx/``) by the spec, size, seed and the sources that built
    the model.  :class:`~opsched.errors.ModelImportError` when the export fails."""
    return onnx_graph_of(load_model(spec, batch, width, seed), width, seed, opt_level=opt_level, cache_dir=cache_dir)


def onnx_graph_of(loaded: LoadedModel, width: float = 1.0, seed: int = 0, *, opt_level: str = "all",
                  cache_dir: str | Path | None = None) -> OpGraph:
    """:func:`load_onnx_graph` of an already loaded model (``width`` and ``seed`` it was loaded with)."""
    from opsched.importers.onnx_graph import from_onnx, from_torch_via_onnx

    spec = loaded.spec
    if loaded.framework == "onnx":
        return from_onnx(loaded.model, loaded.inputs, name=loaded.name, opt_level=opt_level)
    if loaded.framework != "torch":
        raise ModelImportError(f"model spec {spec!r} is a {loaded.framework} model; ONNX Runtime runs ONNX files "
                               "and PyTorch models (exported to ONNX)")
    assert loaded.inputs is not None  # a torch spec always comes with its example inputs
    return from_torch_via_onnx(loaded.model, loaded.inputs, name=loaded.name, key=onnx_export_key(loaded, width, seed),
                               cache_dir=cache_dir, opt_level=opt_level)


def onnx_export_key(loaded: LoadedModel, width: float = 1.0, seed: int = 0) -> str | None:
    """The export cache key of a loaded torch model: its spec, size and seed, and the
    source files that build it (the zoo's, or the user's ``.py``); None for others."""
    from opsched.importers.onnx_graph import export_key
    from opsched.zoo import ZOO

    spec = loaded.spec
    name = spec[len("zoo:"):].partition("@")[0] if spec.startswith("zoo:") else spec
    parts = [spec, f"b{loaded.batch}", f"w{width}", f"s{seed}"]
    if name in ZOO:
        import opsched.zoo

        folder = Path(opsched.zoo.__file__).parent
        return export_key(parts, [folder / f"{ZOO[name].module}.py", folder / "_layers.py"])
    py = _split_py(spec)
    if py is not None:
        return export_key(parts, [py[0]])
    return None


@functools.lru_cache(maxsize=1)
def _importer_hash() -> str:
    """A hash of the zoo and importer sources: a cached zoo graph is reused only
    while the code that built it is unchanged."""
    import opsched.importers
    import opsched.zoo

    h = hashlib.sha256()
    for pkg in (opsched.zoo, opsched.importers):
        assert pkg.__file__ is not None  # regular packages on disk
        for f in sorted(Path(pkg.__file__).parent.glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


__all__ = ["MACHINE_SPECS", "SPEC_KINDS", "LoadedModel", "Machine", "KerasTrainingNetwork", "TrainingNetwork", "keras_application_step", "load_training", "make_keras_optimizer", "make_optimizer", "import_graph", "load_graph", "load_machine",
           "load_model", "load_onnx_graph", "load_torch_model", "onnx_export_key", "onnx_graph_of"]
