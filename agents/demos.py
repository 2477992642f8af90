"""The imitation warm start's demonstrations: observations, masks, expert actions, returns-to-go.

Their own module so that :mod:`opsched.agents.imitation` (which collects and
fits them) and :mod:`opsched.agents.rounds` (which saves them with each
finished round) both import them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch as th

#: Observation entries stored once per episode (they do not change within one).
STATIC_KEYS = ("node_static", "node_mask", "edge_index", "edge_mask", "node_levels")
#: Observation entries stored per decision.
STEP_KEYS = ("node_dynamic", "hardware", "globals")


@dataclass
class Demonstrations:
    """States (static parts stored once per episode), masks, expert actions, returns-to-go."""

    episodes: list[dict[str, np.ndarray]] = field(default_factory=list)
    episode_of: list[int] = field(default_factory=list)
    steps: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in STEP_KEYS})
    masks: list[np.ndarray] = field(default_factory=list)        # packed bits
    actions: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.actions)

    def batch(self, idx: np.ndarray, n_actions: int) -> tuple[dict[str, th.Tensor], th.Tensor, th.Tensor, th.Tensor]:
        eps = [self.episode_of[i] for i in idx]
        obs = {k: th.as_tensor(np.stack([self.episodes[e][k] for e in eps])).float()
               for k in STATIC_KEYS if k in self.episodes[eps[0]]}
        for k in STEP_KEYS:
            obs[k] = th.as_tensor(np.stack([self.steps[k][i] for i in idx]))
        masks = np.unpackbits(np.stack([self.masks[i] for i in idx]), axis=1, count=n_actions).astype(bool)
        return (obs, th.as_tensor(masks), th.as_tensor([self.actions[i] for i in idx]),
                th.as_tensor([self.returns[i] for i in idx], dtype=th.float32))


__all__ = ["STATIC_KEYS", "STEP_KEYS", "Demonstrations"]
