"""The graph encoder's forward pass in plain numpy: what an exported policy runs.

The trained network is :class:`opsched.agents.encoder.GraphEncoder` (its
docstring writes the computation out; the tests' ``numpy_forward`` is the
reference).  This module computes exactly the same function from the exported
arrays, without torch, in two forms:

* :meth:`NumpyEncoder.forward` -- one padded observation in, every action
  logit and the value out (the reference path, used by the faithfulness tests);
* :meth:`NumpyEncoder.episode` -> :class:`EncoderEpisode` -- the fast path the
  scheduler uses.  It precomputes what never changes during an episode (the
  static node features' share of the input layer, the edge lists grouped by
  target and by source) and then scores *only the valid actions* at each
  decision, on the real op slots only (padding rows are zero in the reference
  and take part in no sum, mean or max, so dropping them changes nothing), and
  for the ready ops only (an op's scores depend on its own embedding and the
  global context alone).

The arrays keep torch's ``Linear`` layout (``weight`` is ``(out, in)``, ``y =
x @ weight.T + bias``) under the torch parameter names, so an export is a plain
``state_dict`` dump; :func:`array_shapes` says which names and shapes a given
architecture has.  Computation is float32, like the torch policy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from opsched.engine.layout import (
    DYNAMIC_FEATURES,
    GLOBAL_FEATURES,
    HARDWARE_FEATURES,
    LEVEL_KEY,
    MAX_DEVICES,
    PER_SLOT,
    STATIC_FEATURES,
    EpisodeHintGate,
    hint_columns,
    hint_gate,
    unflatten_obs,
)

F_STATIC, F_DYNAMIC = len(STATIC_FEATURES), len(DYNAMIC_FEATURES)
F_HW, F_GLOB = len(HARDWARE_FEATURES), len(GLOBAL_FEATURES)


def array_shapes(hidden: int, rounds: int, levels: int = 0) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes of a GraphEncoder of this size (torch layout).

    ``levels``: columns of the ``node_levels`` observation the encoder reads
    (``MAX_LEVELS``), or 0 for an encoder trained without it; they follow the
    static and dynamic columns in its input layer."""
    H = int(hidden)
    shapes: dict[str, tuple[int, ...]] = {"inp.weight": (H, F_STATIC + F_DYNAMIC + int(levels)), "inp.bias": (H,)}
    for r in range(int(rounds)):
        shapes[f"self_lin.{r}.weight"] = (H, H)
        shapes[f"self_lin.{r}.bias"] = (H,)
        shapes[f"fwd_lin.{r}.weight"] = (H, H)
        shapes[f"bwd_lin.{r}.weight"] = (H, H)
    shapes.update({
        "ctx.weight": (H, 2 * H + MAX_DEVICES * F_HW + F_GLOB), "ctx.bias": (H,),
        "op_head.weight": (H, H), "op_head.bias": (H,),
        "ctx_head.weight": (H, H),
        "act.weight": (PER_SLOT, H), "act.bias": (PER_SLOT,),
        "wait.weight": (1, H), "wait.bias": (1,),
        "value1.weight": (H, H), "value1.bias": (H,),
        "value2.weight": (1, H), "value2.bias": (1,),
        "hint_prior": (3,),
    })
    return shapes


class NumpyEncoder:
    """The encoder's weights, transposed once for ``x @ W`` products."""

    def __init__(self, arrays: Mapping[str, np.ndarray], hidden: int, rounds: int, levels: int = 0) -> None:
        expected = array_shapes(hidden, rounds, levels)
        missing = sorted(set(expected) - set(arrays))
        if missing:
            raise ValueError(f"missing arrays {missing}")
        bad = {k: arrays[k].shape for k in expected if tuple(arrays[k].shape) != expected[k]}
        if bad:
            raise ValueError(f"arrays with wrong shapes {bad} (expected {({k: expected[k] for k in bad})})")
        f32 = np.float32

        def w(name: str) -> np.ndarray:  # (in, out), contiguous
            return np.ascontiguousarray(np.asarray(arrays[name], f32).T)

        def b(name: str) -> np.ndarray:
            return np.asarray(arrays[name], f32).copy()

        self.hidden, self.rounds, self.levels = int(hidden), int(rounds), int(levels)
        w_in = w("inp.weight")
        f_sd = F_STATIC + F_DYNAMIC
        self.w_in_static, self.w_in_dynamic, self.b_in = w_in[:F_STATIC], w_in[F_STATIC:f_sd], b("inp.bias")
        self.w_in_levels = w_in[f_sd:]  # (levels, H); empty without node_levels
        # One (3H, H) matrix per round: [h | mean over preds | mean over succs] @ it.
        self.w_round = [np.ascontiguousarray(np.concatenate(
            [w(f"self_lin.{r}.weight"), w(f"fwd_lin.{r}.weight"), w(f"bwd_lin.{r}.weight")]))
            for r in range(self.rounds)]
        self.b_round = [b(f"self_lin.{r}.bias") for r in range(self.rounds)]
        self.w_ctx, self.b_ctx = w("ctx.weight"), b("ctx.bias")
        self.w_op, self.b_op = w("op_head.weight"), b("op_head.bias")
        self.w_ctx_head = w("ctx_head.weight")
        self.w_act, self.b_act = w("act.weight"), b("act.bias")
        self.w_wait, self.b_wait = w("wait.weight"), b("wait.bias")
        self.w_v1, self.b_v1 = w("value1.weight"), b("value1.bias")
        self.w_v2, self.b_v2 = w("value2.weight"), b("value2.bias")
        self.hint_prior = b("hint_prior")

    # ----------------------------------------------------------- reference
    def forward(self, obs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, float]:
        """Every action logit (flat layout of ``opsched.engine.layout``, "wait"
        last) and the value, for one padded observation -- the same function as
        ``GraphEncoder.logits_and_value`` on a batch of one.  The observation
        may be the environment's (flattened) or have its logical shapes."""
        node_mask = np.asarray(obs["node_mask"], np.float32)
        N = node_mask.shape[0]
        obs = unflatten_obs(obs, N, np.asarray(obs["edge_mask"]).shape[0])
        x_static = np.asarray(obs["node_static"], np.float32)
        ep = self.episode(x_static, obs["edge_index"], obs["edge_mask"], node_mask,
                          obs[LEVEL_KEY] if self.levels else None)
        h = ep.embed(np.asarray(obs["node_dynamic"], np.float32)[: ep.n])
        c = ep.context(h, np.asarray(obs["hardware"], np.float32), np.asarray(obs["globals"], np.float32))
        # Padding slots score as an op with a zero embedding, as in the torch module.
        h_full = np.zeros((N, self.hidden), np.float32)
        h_full[: ep.n] = h
        u = np.maximum(h_full @ self.w_op + self.b_op + c @ self.w_ctx_head, 0.0)
        static = np.asarray(obs["node_static"], np.float32)
        free = hint_gate(static, np.asarray(obs["node_dynamic"], np.float32), np.asarray(obs["hardware"], np.float32))
        bonus = prior(static, self.hint_prior) * free[:, None]
        scores = (u @ self.w_act + self.b_act + bonus).reshape(N * PER_SLOT)
        logits = np.concatenate([scores, c @ self.w_wait + self.b_wait + wait_prior(static, free, self.hint_prior)])
        value = float((np.maximum(c @ self.w_v1 + self.b_v1, 0.0) @ self.w_v2 + self.b_v2)[0])
        return logits, value

    def episode(self, node_static: np.ndarray, edge_index: np.ndarray, edge_mask: np.ndarray,
                node_mask: np.ndarray, node_levels: np.ndarray | None = None,
                prior_scale: float = 1.0) -> EncoderEpisode:
        """Precompute the static part of one episode (see :class:`EncoderEpisode`);
        ``node_levels`` is required by an encoder that reads it.  ``prior_scale``
        multiplies the hint prior's logit bonuses (1: the trained network as it is)."""
        return EncoderEpisode(self, node_static, edge_index, edge_mask, node_mask, node_levels, prior_scale)


class EncoderEpisode:
    """The encoder bound to one graph: static work done once, then per decision
    only what the dynamic state changed.

    Real ops must fill the first ``n`` slots (the environment's layout); the
    real edges are those with ``edge_mask != 0``, weighted by it.  A
    message-passing round is one product with the row-normalised adjacency
    (dense: at ``n <= max_nodes`` a BLAS product beats any numpy scatter).

    Between two decisions only a few ops change state (the one just started;
    or, when time advanced, the running, finished and newly ready ones).  A
    round is linear before its ReLU, ``z = h S + A_pred h P + A_succ h Q + b``,
    so :meth:`embed` keeps every round's ``z`` and ``h`` and pushes only the
    *changes*: rows ``C`` of ``h`` moving by ``D`` move ``z`` by ``D S`` on ``C``
    and by ``A[:, C] (D P)``, ``A[:, C] (D Q)`` on their neighbours -- work in
    proportion to the changed rows, not to the graph.  Updates accumulate
    float32 rounding, so every :attr:`REFRESH` decisions (and whenever most
    rows changed) a full pass starts afresh; the difference from a full pass is
    float rounding (pinned by a test).
    """

    #: A round whose changed input rows exceed this fraction of the ops is recomputed in full.
    FULL_PASS = 0.5
    #: A full pass at least every this many incremental updates (bounds the rounding drift).
    REFRESH = 32

    def __init__(self, enc: NumpyEncoder, node_static: np.ndarray, edge_index: np.ndarray,
                 edge_mask: np.ndarray, node_mask: np.ndarray, node_levels: np.ndarray | None = None,
                 prior_scale: float = 1.0) -> None:
        self.enc = enc
        node_mask = np.asarray(node_mask, np.float32)
        n = int(np.count_nonzero(node_mask))
        if not np.all(node_mask[:n] == 1.0) or np.any(node_mask[n:]):
            raise ValueError("node_mask must be 1 on a prefix of the slots and 0 after it")
        self.n = n
        N = node_mask.shape[0]
        x_static = np.asarray(node_static, np.float32)[:n]
        self.pre = x_static @ enc.w_in_static + enc.b_in  # (n, H): static share of the input layer
        # (n, PER_SLOT): the heuristic's plan as a logit bonus
        self.prior = prior(x_static, enc.hint_prior) if prior_scale == 1.0 else \
            prior(x_static, enc.hint_prior * np.float32(prior_scale))
        self.static = x_static
        self.gate = EpisodeHintGate(x_static)
        self.wait_prior = float(enc.hint_prior[2]) * float(prior_scale) if hint_columns(x_static)[1].any() else 0.0
        if enc.levels:  # node_levels is static within an episode too
            if node_levels is None:
                raise ValueError(f"this encoder reads {LEVEL_KEY} ({enc.levels} columns); none given")
            self.pre += np.asarray(node_levels, np.float32)[:n, : enc.levels] @ enc.w_in_levels
        e = np.asarray(edge_mask, np.float32)
        idx = np.clip(np.asarray(edge_index, np.int64), 0, N - 1)
        keep = np.flatnonzero(e)
        src, dst, e = idx[0, keep], idx[1, keep], e[keep]
        if np.any(src >= n) or np.any(dst >= n):
            raise ValueError("a real edge touches a padding slot")
        adj = np.zeros((2, n, n), np.float32)
        np.add.at(adj[0], (dst, src), e)   # adj[0][i, j]: weight of edge j -> i (mean over predecessors)
        np.add.at(adj[1], (src, dst), e)   # adj[1][i, j]: weight of edge i -> j (mean over successors)
        adj /= np.maximum(adj.sum(axis=2, keepdims=True), 1.0)
        self.adj = adj.reshape(2 * n, n)
        #: ``adj_cols[j]`` (3, n): column j of the identity, of the predecessor
        #: mean and of the successor mean (where row j of h goes), so that a
        #: change ``D`` of rows C of h reaches z through one gather,
        #: ``adj_cols[C].reshape(3k, n)``, and one product with ``(D [S | P |
        #: Q]).reshape(3k, H)``, a free view.
        self.adj_cols = np.ascontiguousarray(np.stack([np.eye(n, dtype=np.float32), adj[0].T, adj[1].T], axis=1))
        #: Symmetric "i and j are neighbours or equal": the rows a changed row reaches in one round ...
        self.near = (adj[0] != 0) | (adj[1] != 0) | (adj[0] != 0).T | (adj[1] != 0).T | np.eye(n, dtype=bool)
        #: ... and, per row, those rows as indices (one changed row - a start - is the common case).
        self.near_rows = [np.flatnonzero(row) for row in self.near]
        H = enc.hidden
        #: Per round [S | P | Q] side by side (H, 3H), for pushing changes.
        self.w_side = [np.ascontiguousarray(np.concatenate([w[:H], w[H:2 * H], w[2 * H:]], axis=1))
                       for w in enc.w_round]
        self._dyn: np.ndarray | None = None
        self._h: list[np.ndarray] = []  # after the input layer and after each round
        self._z: list[np.ndarray] = []  # each round's pre-activation
        self._updates = 0

    def embed(self, node_dynamic: np.ndarray) -> np.ndarray:
        """The op embeddings ``h`` (n, H) after the message-passing rounds, for
        the real slots' dynamic features ``node_dynamic`` (n, F_dynamic)."""
        dyn = np.asarray(node_dynamic, np.float32)
        if self._dyn is None or self._updates >= self.REFRESH:
            return self._full(dyn)
        rows = (dyn != self._dyn).any(axis=1).nonzero()[0]  # 1-D: nonzero, not flatnonzero (a ravel less per call)
        if len(rows) == 0:
            return self._h[-1]
        enc, H = self.enc, self.enc.hidden
        self._dyn, self._updates = dyn, self._updates + 1
        delta = _store(self._h[0], rows, np.maximum(self.pre[rows] + dyn[rows] @ enc.w_in_dynamic, 0.0))
        last = enc.rounds - 1
        for r in range(enc.rounds):
            if len(rows) > self.FULL_PASS * self.n:
                for r2 in range(r, enc.rounds):
                    self._z[r2], self._h[r2 + 1] = self._round(self._h[r2], r2)
                break
            d = (delta @ self.w_side[r]).reshape(-1, H)  # (3k, H): the change times S, P and Q
            z = self._z[r]
            if len(rows) == 1:  # one changed row (a start): it reaches only its neighbours
                i = rows[0]
                rows = self.near_rows[i]
                z[rows] += self.adj_cols[i][:, rows].T @ d
            else:
                z += self.adj_cols[rows].reshape(len(d), -1).T @ d
                rows = self.near[rows].any(axis=0).nonzero()[0]
            if r == last:  # no round after this one: its change is not needed
                self._h[-1][rows] = np.maximum(z[rows], 0.0)
            else:
                delta = _store(self._h[r + 1], rows, np.maximum(z[rows], 0.0))
        return self._h[-1]

    def _round(self, h: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        """One full round: (pre-activation z, h = relu(z))."""
        agg = self.adj @ h  # (2n, H): mean over predecessors, then over successors
        n = self.n
        z = np.concatenate([h, agg[:n], agg[n:]], axis=1) @ self.enc.w_round[r] + self.enc.b_round[r]
        return z, np.maximum(z, 0.0)

    def _full(self, dyn: np.ndarray) -> np.ndarray:
        self._dyn, self._updates = dyn, 0
        h = np.maximum(self.pre + dyn @ self.enc.w_in_dynamic, 0.0)
        self._h, self._z = [h], []
        for r in range(self.enc.rounds):
            z, h = self._round(h, r)
            self._z.append(z)
            self._h.append(h)
        return h

    def context(self, h: np.ndarray, hardware: np.ndarray, globals_: np.ndarray) -> np.ndarray:
        """The global context ``c`` (H,): op embeddings pooled with the machine state."""
        enc = self.enc
        if self.n:
            mean, top = h.sum(0) / np.float32(self.n), h.max(0)
        else:
            mean = top = np.zeros(enc.hidden, np.float32)
        pooled = np.concatenate([mean, top, hardware.reshape(-1), globals_])
        return np.maximum(pooled @ enc.w_ctx + enc.b_ctx, 0.0)

    def scores(self, node_dynamic: np.ndarray, hardware: np.ndarray, globals_: np.ndarray,
               actions: np.ndarray, wait: int) -> np.ndarray:
        """The logits of ``actions`` (ascending flat action indices; ``wait`` may
        be among them), in the same order."""
        dyn = np.asarray(node_dynamic, np.float32)[: self.n]
        h = self.embed(dyn)
        c = self.context(h, np.asarray(hardware, np.float32), np.asarray(globals_, np.float32))
        free = self.gate(dyn, np.asarray(hardware, np.float32))
        has_wait = len(actions) > 0 and actions[-1] == wait
        starts = actions[:-1] if has_wait else actions
        out = np.empty(len(actions), np.float32)
        if len(starts):
            slot, col = np.divmod(starts, PER_SLOT)
            new = np.empty(len(slot), bool)  # actions ascend, so each op's actions are contiguous
            new[0] = True
            np.not_equal(slot[1:], slot[:-1], out=new[1:])
            ops, pos = slot[new], np.cumsum(new) - 1
            out[: len(starts)] = self._op_scores(h, c, ops, free)[pos, col]
        if has_wait:
            out[-1] = self._wait_score(c, free)
        return out

    def grid_scores(self, node_dynamic: np.ndarray, hardware: np.ndarray, globals_: np.ndarray,
                    ops: np.ndarray, cols: np.ndarray, wait: bool) -> np.ndarray:
        """The logits of the valid actions given in factored form
        (:meth:`opsched.engine.observe.Observer.choices`): every (op, column)
        start, ops ascending then columns ascending, then "wait" if ``wait`` -
        the order and values of :meth:`scores` on the same actions, without
        building or scanning the flat action list."""
        dyn = np.asarray(node_dynamic, np.float32)[: self.n]
        h = self.embed(dyn)
        c = self.context(h, np.asarray(hardware, np.float32), np.asarray(globals_, np.float32))
        free = self.gate(dyn, np.asarray(hardware, np.float32))
        grid = (self._op_scores(h, c, ops, free)[:, cols].ravel() if len(ops) and len(cols)
                else np.empty(0, np.float32))
        return np.append(grid, self._wait_score(c, free)) if wait else grid

    def _op_scores(self, h: np.ndarray, c: np.ndarray, ops: np.ndarray, free: np.ndarray) -> np.ndarray:
        """(len(ops), PER_SLOT): every (device, level) logit of ops ``ops`` (ascending)."""
        enc = self.enc
        u = np.maximum(h[ops] @ enc.w_op + enc.b_op + c @ enc.w_ctx_head, 0.0)
        return u @ enc.w_act + enc.b_act + self.prior[ops] * free[ops, None]

    def _wait_score(self, c: np.ndarray, free: np.ndarray) -> np.float32:
        return (c @ self.enc.w_wait + self.enc.b_wait)[0] + self.wait_prior * (1.0 - (free.max() if len(free) else 0.0))


def _store(h: np.ndarray, rows: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Store ``new`` into ``h[rows]`` and return the change (rows that did not
    move carry zeros, which push nothing; filtering them out costs more than
    it saves, since after a ReLU nearly every reached row moves)."""
    delta = new - h[rows]
    h[rows] = new
    return delta


def prior(node_static: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(rows, PER_SLOT): the hint prior of ``agents.encoder.GraphEncoder._prior``
    before its gate (:func:`~opsched.engine.layout.hint_gate`):
    ``weights[0] + weights[1] * hint_order`` on each op's hinted column."""
    flat, has, order = hint_columns(node_static)
    out = np.zeros((node_static.shape[0], PER_SLOT), np.float32)
    rows = np.flatnonzero(has)
    out[rows, flat[rows].astype(np.int64)] = weights[0] + weights[1] * order[rows]
    return out


def wait_prior(node_static: np.ndarray, free: np.ndarray, weights: np.ndarray) -> float:
    """The prior's bonus on "wait": ``weights[2]`` while no hinted op is free to start."""
    if not hint_columns(node_static)[1].any():
        return 0.0
    return float(weights[2]) * (1.0 - float(free.max()) if len(free) else 1.0)


def greedy(scores: np.ndarray) -> int:
    """The position of the deterministic choice among ``scores`` (the valid
    actions' logits, in ascending action order): the first maximum.

    SB3's deterministic action is ``argmax`` of the masked categorical's
    float32 *probabilities*, the same choice except where two logits lie
    within float32 rounding of each other (~1e-7): there torch's own rounding
    of its logsumexp decides which one wins, and no independent
    implementation reproduces that bit for bit.  Those near-ties are the only
    disagreements the faithfulness test allows."""
    return int(np.argmax(scores))


__all__ = ["NumpyEncoder", "EncoderEpisode", "array_shapes"]
