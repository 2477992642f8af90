"""Reference implementations the package's fast paths are pinned against (test-only).

* :func:`numpy_forward` -- the graph encoder for ONE observation in plain numpy,
  the computation ``opsched/agents/encoder.py``'s docstring writes out; the
  torch module and the exported numpy scheduler must equal it;
* :func:`observe` -- an observation built from scratch from the simulator
  state, against which the engine's incremental ``Observer`` is checked.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from opsched.engine.layout import (
    DYNAMIC_FEATURES,
    LEVEL_KEY,
    MAX_DEVICES,
    MAX_LEVELS,
    STATIC_FEATURES,
    hint_gate,
)
from opsched.engine.observe import EpisodeData, Observer
from opsched.engine.sim import RUNNING, SimState
from opsched.policies.numpy_encoder import prior, wait_prior

_D = {k: i for i, k in enumerate(DYNAMIC_FEATURES)}


def numpy_params(encoder) -> dict[str, np.ndarray]:
    """The encoder's weights as plain arrays (torch ``Linear`` stores W transposed:
    ``y = x @ weight.T + bias``), keyed by parameter name."""
    return {k: v.detach().cpu().numpy().astype(np.float64) for k, v in encoder.state_dict().items()}


def numpy_forward(params: Mapping[str, np.ndarray], obs: Mapping[str, np.ndarray],
                  rounds: int) -> tuple[np.ndarray, float]:
    """The encoder for ONE (unbatched, flattened or shaped) observation: (logits, value)."""

    def lin(name: str, x: np.ndarray) -> np.ndarray:
        y = x @ params[f"{name}.weight"].T
        bias = params.get(f"{name}.bias")
        return y if bias is None else y + bias

    relu = lambda a: np.maximum(a, 0.0)  # noqa: E731
    N = np.asarray(obs["node_mask"]).size
    fs, fd = len(STATIC_FEATURES), len(DYNAMIC_FEATURES)
    parts = [np.asarray(obs["node_static"]).reshape(N, fs), np.asarray(obs["node_dynamic"]).reshape(N, fd)]
    if params["inp.weight"].shape[1] > fs + fd:  # the encoder reads node_levels
        parts.append(np.asarray(obs[LEVEL_KEY]).reshape(N, MAX_LEVELS))
    x = np.concatenate(parts, axis=-1).astype(np.float64)
    m = np.asarray(obs["node_mask"], dtype=np.float64).reshape(N, 1)
    e = np.asarray(obs["edge_mask"], dtype=np.float64).reshape(-1, 1)
    pairs = np.clip(np.asarray(obs["edge_index"]).reshape(2, -1).T.astype(np.int64), 0, N - 1)
    src, dst = pairs[:, 0], pairs[:, 1]
    indeg = np.maximum(np.bincount(dst, weights=e[:, 0], minlength=N), 1.0).reshape(N, 1)
    outdeg = np.maximum(np.bincount(src, weights=e[:, 0], minlength=N), 1.0).reshape(N, 1)

    h = relu(lin("inp", x)) * m
    for r in range(rounds):
        fwd = np.zeros_like(h)
        bwd = np.zeros_like(h)
        np.add.at(fwd, dst, h[src] * e)
        np.add.at(bwd, src, h[dst] * e)
        h = relu(lin(f"self_lin.{r}", h) + lin(f"fwd_lin.{r}", fwd / indeg) + lin(f"bwd_lin.{r}", bwd / outdeg)) * m

    pooled = np.concatenate([
        (h * m).sum(0) / max(m.sum(), 1.0),
        (h * m).max(0),
        np.asarray(obs["hardware"], dtype=np.float64).reshape(-1),
        np.asarray(obs["globals"], dtype=np.float64),
    ])
    c = relu(lin("ctx", pooled))
    u = relu(lin("op_head", h) + lin("ctx_head", c)[None, :])
    static = np.asarray(obs["node_static"]).reshape(N, fs)
    free = hint_gate(static, np.asarray(obs["node_dynamic"]).reshape(N, fd),
                     np.asarray(obs["hardware"]).reshape(MAX_DEVICES, -1))
    bonus = prior(static, params["hint_prior"]) * free[:, None]
    scores = (lin("act", u) + bonus).reshape(N * MAX_DEVICES * MAX_LEVELS)
    logits = np.concatenate([scores, lin("wait", c) + wait_prior(static, free, params["hint_prior"])])
    value = float(lin("value2", relu(lin("value1", c)))[0])
    return logits, value


def observe(data: EpisodeData, st: SimState) -> dict[str, np.ndarray]:
    """The observation (logical shapes) of simulator state ``st``, built from scratch."""
    n = data.n
    obs = Observer(data, st)
    status = np.fromiter(st.status, dtype=np.int64, count=n)
    obs.dyn[:n, :4] = np.eye(4, dtype=np.float32)[status]
    for i in np.flatnonzero(status >= RUNNING):
        obs.dyn[i, _D["device_frac"]] = (st.device[i] + 1) / MAX_DEVICES
        obs.dyn[i, _D["threads_frac"]] = st.threads[i] / data.slots[st.device[i]]
    obs.dyn[:, _D["hint_free"]] = 0.0
    for i in range(n):  # ready, and every slot the hinted plan holds it for is done
        if data.hint_after and status[i] == 1 and all(status[j] == 3 for j in data.hint_after[i]):
            obs.dyn[i, _D["hint_free"]] = 1.0
    return obs.observe()
