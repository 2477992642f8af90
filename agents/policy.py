"""The actor-critic policy MaskablePPO trains: SB3's own
``MaskableActorCriticPolicy`` with the graph encoder as its features extractor.

Wiring, through SB3's documented extension points only: the features
extractor (:class:`~opsched.agents.encoder.GraphEncoder`) already computes the
per-op action logits and the value, so the "MLP extractor" just splits its
output and the action and value nets are identities.  The algorithm itself
(MaskablePPO) is used unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch as th
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.preprocessing import preprocess_obs
from torch import nn

from opsched.agents.encoder import GraphEncoder


class SplitHeads(nn.Module):
    """Split the encoder's ``[logits, value]`` into the actor and critic latents."""

    def __init__(self, n_actions: int) -> None:
        super().__init__()
        self.n_actions = n_actions
        self.latent_dim_pi = n_actions
        self.latent_dim_vf = 1

    def forward(self, features: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        return self.forward_actor(features), self.forward_critic(features)

    def forward_actor(self, features: th.Tensor) -> th.Tensor:
        return features[:, : self.n_actions]

    def forward_critic(self, features: th.Tensor) -> th.Tensor:
        return features[:, self.n_actions:]


class GraphPolicy(MaskableActorCriticPolicy):
    """MaskableActorCriticPolicy whose logits are scored per op by the graph encoder.

    ``hidden`` and ``rounds`` size the encoder (embedding width, message-passing
    rounds); ``levels``: whether it reads ``node_levels``; everything else is SB3's.
    """

    def __init__(self, observation_space, action_space, lr_schedule, hidden: int = 64, rounds: int = 3,
                 levels: bool = True, **kwargs: Any) -> None:
        kwargs["features_extractor_class"] = GraphEncoder
        kwargs["features_extractor_kwargs"] = dict(hidden=int(hidden), rounds=int(rounds), levels=bool(levels))
        kwargs["share_features_extractor"] = True
        kwargs["ortho_init"] = False  # the encoder initialises its own output heads
        kwargs.setdefault("net_arch", [])
        self.hidden, self.rounds, self.levels = int(hidden), int(rounds), bool(levels)
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = SplitHeads(self.encoder.n_actions)

    def _build(self, lr_schedule) -> None:
        self._build_mlp_extractor()
        self.action_net = nn.Identity()
        self.value_net = nn.Identity()
        # as SB3's own _build: optimizer_class is typed as the Optimizer base, whose __init__ has no lr
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1),  # pyright: ignore[reportCallIssue]
                                              **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        data = super()._get_constructor_parameters()
        for key in ("features_extractor_class", "features_extractor_kwargs", "ortho_init", "net_arch"):
            data.pop(key, None)
        data.update(hidden=self.hidden, rounds=self.rounds, levels=self.levels)
        return data

    @property
    def encoder(self) -> GraphEncoder:
        return self.features_extractor  # type: ignore[return-value]


def action_logits(policy: GraphPolicy, obs: dict[str, np.ndarray]) -> np.ndarray:
    """The deterministic action logits (unmasked) for ONE observation, as numpy.

    The greedy action is ``argmax(where(mask, logits, -inf))``; the exported
    numpy scheduler must reproduce these logits (``opsched.policies.numpy_encoder``)."""
    policy.set_training_mode(False)
    tensor, _ = policy.obs_to_tensor(obs)
    with th.no_grad():
        features = preprocess_obs(tensor, policy.observation_space, policy.normalize_images)
        assert isinstance(features, dict)  # a Dict observation space preprocesses to a dict of tensors
        logits, _ = policy.encoder.logits_and_value(features)
    return logits[0].cpu().numpy()


def greedy_action(policy: GraphPolicy, obs: dict[str, np.ndarray], mask: np.ndarray) -> int:
    """The masked argmax of :func:`action_logits`: what ``predict(deterministic=True)`` picks."""
    logits = action_logits(policy, obs)
    return int(np.argmax(np.where(np.asarray(mask, dtype=bool), logits, -np.inf)))


@contextmanager
def hint_prior_scaled(policy: Any, scale: float) -> Iterator[None]:
    """Inside the block, ``policy``'s learned hint prior is multiplied by
    ``scale``: what the exported scheduler does at plan time
    (``prior_scale`` in :data:`opsched.policies.exported.DEFAULT_PLANNING`), so
    validation scores the greedy decoding that ships, not the network at x1.
    The prior is linear in its three scalars, so scaling them scales every
    bonus, as the numpy encoder does.  The weights are restored on leaving,
    also on an exception or Ctrl-C, so a saved model is the trained one."""
    prior = getattr(getattr(policy, "features_extractor", None), "hint_prior", None)
    if prior is None or float(scale) == 1.0:
        yield
        return
    with th.no_grad():
        saved = prior.detach().clone()
        prior.mul_(float(scale))
    try:
        yield
    finally:
        with th.no_grad():
            prior.copy_(saved)
