"""The graph encoder: message passing over the op DAG, pooled with the hardware
state into a global context, and actions scored per op.

Why a graph network and not an MLP over the padded observation: the same
weights must schedule a 20-op graph on a 2-core laptop and a 300-op graph on a
68-core KNL.  Every weight here acts on one op or one edge at a time, or on
the fixed-size machine state (``MAX_DEVICES`` rows) and pooled summaries, so
nothing depends on ``max_nodes`` or the graph's size, and renumbering the ops
renumbers the scores (permutation consistency, pinned by a test).

The exact computation, for ONE observation (the torch module computes the
same thing batched; ``opsched.policies.numpy_encoder`` incrementally).  Dense ops
only: matmuls, ReLU, scatter-add, masked pooling, so an exported policy can
run it in plain numpy.

    X      = [node_static | node_dynamic | node_levels]          (N x F)
             (node_levels: each op's speed-up at every CPU thread level; read
             unless the encoder is built with ``levels=False``)
    m      = node_mask                                           (N,)   1 = real op
    (s, t) = edge_index rows 0 and 1 (source, target op slots)   (E,)
    e      = edge_mask                                           (E,)   1 = real edge

    h      = relu(X @ W_in + b_in) * m[:, None]
    repeat for r = 0 .. rounds-1   (separate weights per round):
        fwd[i] = sum_{j: t_j = i} e_j h[s_j] / max(1, sum_{j: t_j = i} e_j)   (mean over predecessors)
        bwd[i] = sum_{j: s_j = i} e_j h[t_j] / max(1, sum_{j: s_j = i} e_j)   (mean over successors)
        h      = relu(h @ S_r + fwd @ P_r + bwd @ Q_r + b_r) * m[:, None]
    pool   = [ sum_i m_i h_i / max(1, sum m),                    masked mean of the op embeddings
               max_i h_i * m_i,                                  masked max (h >= 0, padding is 0)
               hardware.reshape(MAX_DEVICES * F_hw),             every device's state, in device order
               globals ]
    c      = relu(pool @ W_ctx + b_ctx)                          (H,)      the global context
    u_i    = relu(h_i @ A_op + c @ A_ctx + a)                    (N x H)   op i in context
    score  = u @ W_act + b_act                                   (N x MAX_DEVICES * MAX_LEVELS)
           + f_i * (p_0 * onehot(hinted column_i) + p_1 * hint_order_i)   the prior: the best heuristic's
                                                                 plan, for ops it would start now (f = hint_free;
                                                                 p = hint_prior, 3 learned scalars)
    logits = [ score.reshape(N * MAX_DEVICES * MAX_LEVELS) , c @ w_wait + b_wait + p_2 * (1 - max_i f_i) ]
    value  = relu(c @ V_1 + v_1) @ V_2 + v_2

The reshape is row-major over (op slot, device, level), which is exactly the
flat action order of :mod:`opsched.engine.layout`:
``(slot * MAX_DEVICES + device) * MAX_LEVELS + level``, then "wait".
Masking of invalid actions is the env's ``action_masks()`` (MaskablePPO sets
their logits to -inf); the encoder never needs to know which are valid.
"""

from __future__ import annotations

from collections.abc import Mapping

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from opsched.engine.layout import (
    DYNAMIC_FEATURES,
    GLOBAL_FEATURES,
    HARDWARE_FEATURES,
    LEVEL_KEY,
    MAX_DEVICES,
    MAX_LEVELS,
    OBS_KEYS,
    STATIC_FEATURES,
    hint_columns,
    hint_gate,
    unflatten_obs,
)

#: Initial weights of the hint prior (logit bonus of the heuristic's column, of its order).
HINT_PRIOR_INIT = 4.0


def _edge_pairs(edge_index, n_edges: int):
    """(..., E, 2) (source, target) view of the env's ``edge_index`` (..., 2, E)."""
    if edge_index.shape[-2:] != (2, n_edges):
        raise ValueError(f"edge_index has shape {tuple(edge_index.shape)}, expected (..., 2, {n_edges})")
    if isinstance(edge_index, th.Tensor):
        return edge_index.transpose(-1, -2)
    return np.swapaxes(edge_index, -1, -2)


def _length(space: gym.spaces.Dict, key: str) -> int:
    """The first dimension of the observation entry ``key`` (a Box: it has a shape)."""
    shape = space[key].shape
    if not shape:
        raise ValueError(f"observation entry {key!r} has no shape; the encoder reads arrays (opsched/engine/layout.py)")
    return int(shape[0])


class GraphEncoder(BaseFeaturesExtractor):
    """Features extractor that already holds the policy's action and value heads.

    Its output is ``[action logits (n_actions), value (1)]``: SB3's actor-critic
    policy then only splits it (see :class:`opsched.agents.policy.GraphPolicy`),
    so the logits stay a per-op function of the graph instead of passing through
    a fixed-width MLP.
    """

    def __init__(self, observation_space: gym.spaces.Dict, hidden: int = 64, rounds: int = 3,
                 levels: bool = True) -> None:
        n_nodes = _length(observation_space, "node_mask")
        f_static, f_dynamic = len(STATIC_FEATURES), len(DYNAMIC_FEATURES)
        self.node_keys = ("node_static", "node_dynamic") + ((LEVEL_KEY,) if levels else ())
        f_levels = MAX_LEVELS if levels else 0
        n_devices, f_hw = MAX_DEVICES, len(HARDWARE_FEATURES)
        f_glob = len(GLOBAL_FEATURES)
        self.n_nodes = int(n_nodes)
        self.n_actions = self.n_nodes * MAX_DEVICES * MAX_LEVELS + 1
        super().__init__(observation_space, features_dim=self.n_actions + 1)
        missing = [k for k in OBS_KEYS if k not in observation_space.spaces]
        if missing:
            raise ValueError(f"observation lacks {missing}; the encoder reads {OBS_KEYS} (opsched/engine/layout.py)")
        self.n_edges = _length(observation_space, "edge_mask")
        self.hidden, self.rounds = int(hidden), int(rounds)
        H = self.hidden
        self.inp = nn.Linear(f_static + f_dynamic + f_levels, H)
        self.self_lin = nn.ModuleList(nn.Linear(H, H) for _ in range(rounds))
        self.fwd_lin = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(rounds))
        self.bwd_lin = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(rounds))
        self.ctx = nn.Linear(2 * H + n_devices * f_hw + f_glob, H)
        self.op_head = nn.Linear(H, H)
        self.ctx_head = nn.Linear(H, H, bias=False)
        self.act = nn.Linear(H, MAX_DEVICES * MAX_LEVELS)
        self.wait = nn.Linear(H, 1)
        self.value1 = nn.Linear(H, H)
        self.value2 = nn.Linear(H, 1)
        # Start near the uniform policy over valid actions (PPO's usual small
        # output gain), so early exploration is not biased by random weights...
        for head in (self.act, self.wait):
            nn.init.orthogonal_(head.weight, gain=0.01)
            nn.init.zeros_(head.bias)
        # ... plus the prior towards the best heuristic's plan (see _prior).
        self.hint_prior = nn.Parameter(th.tensor([HINT_PRIOR_INIT] * 3))

    def forward(self, obs: Mapping[str, th.Tensor]) -> th.Tensor:
        logits, value = self.logits_and_value(obs)
        return th.cat([logits, value], dim=1)

    def logits_and_value(self, obs: Mapping[str, th.Tensor]) -> tuple[th.Tensor, th.Tensor]:
        """(logits [B, n_actions], value [B, 1]).

        Padding is skipped: only the op slots and edges up to the last real one
        in the batch are computed (the env packs real ops and edges first; this
        holds without it too), and the padded slots get the scores of an op
        with a zero embedding -- exactly what the full computation gives them."""
        obs = unflatten_obs(obs, self.n_nodes, self.n_edges, batch=True)
        node_mask = obs["node_mask"]
        B, N = node_mask.shape
        n = _used(node_mask)
        n_e = _used(obs["edge_mask"])
        x = th.cat([obs[k][:, :n] for k in self.node_keys], dim=-1)
        m = node_mask[:, :n].unsqueeze(-1)
        pairs = _edge_pairs(obs["edge_index"], self.n_edges)[:, :n_e].long().clamp(0, max(n - 1, 0))
        e_flat = obs["edge_mask"][:, :n_e].reshape(-1, 1)
        offset = (th.arange(B, device=x.device) * n).reshape(B, 1)
        src = (pairs[..., 0] + offset).reshape(-1)
        dst = (pairs[..., 1] + offset).reshape(-1)
        zeros1 = th.zeros(B * n, 1, device=x.device)
        indeg = zeros1.index_add(0, dst, e_flat).clamp_(min=1.0)
        outdeg = zeros1.index_add(0, src, e_flat).clamp_(min=1.0)

        h = th.relu(self.inp(x)) * m
        for r in range(self.rounds):
            hf = h.reshape(B * n, -1)
            zeros = th.zeros_like(hf)
            fwd = zeros.index_add(0, dst, hf[src] * e_flat) / indeg
            bwd = zeros.index_add(0, src, hf[dst] * e_flat) / outdeg
            h = th.relu(self.self_lin[r](h) + self.fwd_lin[r](fwd.reshape(B, n, -1))
                        + self.bwd_lin[r](bwd.reshape(B, n, -1))) * m

        pooled = th.cat([
            (h * m).sum(1) / m.sum(1).clamp(min=1.0),
            (h * m).max(1).values if n > 0 else h.new_zeros(B, self.hidden),
            obs["hardware"].reshape(B, -1),
            obs["globals"],
        ], dim=1)
        c = th.relu(self.ctx(pooled))
        cterm = self.ctx_head(c).unsqueeze(1)                                  # (B, 1, H)
        per_op = self.act(th.relu(self.op_head(h) + cterm))                    # (B, n, D*L)
        if n < N:
            pad = self.act(th.relu(self.op_head.bias + cterm))                 # an op with h = 0
            per_op = th.cat([per_op, pad.expand(B, N - n, -1)], dim=1)
        bonus, wait_bonus = self._prior(obs["node_static"], obs["node_dynamic"], obs["hardware"])
        logits = th.cat([(per_op + bonus).reshape(B, N * MAX_DEVICES * MAX_LEVELS), self.wait(c) + wait_bonus],
                        dim=1)
        value = self.value2(th.relu(self.value1(c)))
        return logits, value

    def _prior(self, node_static: th.Tensor, node_dynamic: th.Tensor,
               hardware: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """The best heuristic's plan as logit bonuses on the hinted (device, level)
        column of every op it would start now (:func:`~opsched.engine.layout.hint_gate`):
        ``hint_prior[0] + hint_prior[1] * hint_order``; and ``hint_prior[2]`` on
        "wait" while it would start none.  The policy starts out as the
        heuristic's dispatch rule and learns where to deviate.  Returns
        ((B, N, D*L), (B, 1))."""
        flat, has, order = hint_columns(node_static)
        gate = hint_gate(node_static, node_dynamic, hardware)
        onehot = th.zeros(*flat.shape, MAX_DEVICES * MAX_LEVELS, dtype=node_static.dtype,
                          device=node_static.device)
        weight = (self.hint_prior[0] + self.hint_prior[1] * order) * gate
        onehot = onehot.scatter(-1, flat.clamp(min=0).long().unsqueeze(-1), weight.unsqueeze(-1))
        hinted = has.any(dim=-1, keepdim=True).to(node_static.dtype)
        wait = self.hint_prior[2] * hinted * (1.0 - gate.amax(dim=-1, keepdim=True))
        return onehot, wait


def _used(mask: th.Tensor) -> int:
    """1 + the last index any row of the batch uses (0 if none)."""
    cols = th.nonzero(mask.any(0))
    return int(cols.max()) + 1 if cols.numel() else 0
