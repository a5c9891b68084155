"""A trained DeepShare policy on disk and as a decider (needs the ``rl`` extra: torch,
stable-baselines3).

The file is a zip of two members: ``meta.json`` (the layout the model was trained for, its
network, reward weight, training steps, time, machine and load) and ``policy.pt`` (the actor-critic
network's weights, loaded with ``weights_only``). Only what running the policy needs is kept --
not PPO's optimizer state, which would triple the file -- so a file of about 0.4 MB holds it;
``python -m simulator.rl_train`` writes one.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy

from simulator.rl_state import ACTION_FEATURES, GLOBALS, Layout, LayoutError, Point

FORMAT = "themis-deepshare-rl/1"


def spaces_of(layout: Layout) -> tuple[spaces.Box, spaces.Discrete]:
    """The observation and action spaces of a layout (the environment's and the model's)."""
    return (spaces.Box(0.0, 1.0, shape=(layout.obs_size,), dtype=np.float32), spaces.Discrete(layout.n_actions))


def valid_mask(obs: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Which actions are valid, read from observations (a batch): the per-action "valid" features,
    and NOTHING where some GPU is busy (``rl_state``: an empty cluster cannot wait)."""
    start = math.prod(layout.grid_shape)
    placements = obs[:, start:start + (layout.n_actions - 1) * ACTION_FEATURES:ACTION_FEATURES] > 0.5
    nothing = obs[:, -GLOBALS:-GLOBALS + 1] > 0.0
    return torch.cat([nothing, placements], dim=1)


class MaskedActorCritic(ActorCriticPolicy):
    """stable-baselines3's actor-critic with the logits of invalid actions masked out, the mask read
    from the observation itself (what sb3-contrib's MaskablePPO does with a mask beside it). The
    mask is a function of the observation, so this is still PPO's policy gradient; it spares PPO
    from learning which of 21 node lists fit before it can learn which are good."""

    def __init__(self, observation_space, action_space, lr_schedule, *, layout: Layout, **kwargs):
        self.layout = layout
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _masked(self, obs: torch.Tensor, latent_pi: torch.Tensor):
        logits = self.action_net(latent_pi).masked_fill(~valid_mask(obs, self.layout), -1e9)
        return self.action_dist.proba_distribution(action_logits=logits)

    def forward(self, obs: torch.Tensor, deterministic: bool = False):
        latent_pi, latent_vf = self.mlp_extractor(self.extract_features(obs))
        distribution = self._masked(obs, latent_pi)
        actions = distribution.get_actions(deterministic=deterministic)
        return actions.reshape((-1, *self.action_space.shape)), self.value_net(latent_vf), distribution.log_prob(actions)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):
        latent_pi, latent_vf = self.mlp_extractor(self.extract_features(obs))
        distribution = self._masked(obs, latent_pi)
        return self.value_net(latent_vf), distribution.log_prob(actions), distribution.entropy()

    def get_distribution(self, obs: torch.Tensor):
        return self._masked(obs, self.mlp_extractor.forward_actor(self.extract_features(obs)))


def network(layout: Layout, net_arch: list[int]) -> MaskedActorCritic:
    obs_space, act_space = spaces_of(layout)
    return MaskedActorCritic(obs_space, act_space, lambda _: 0.0, layout=layout, net_arch=list(net_arch))


class TrainedModel:
    """A trained network as a decider: the valid action it gives the highest probability."""

    def __init__(self, policy: ActorCriticPolicy, layout: Layout, meta: Mapping[str, Any]):
        self.policy = policy.eval()
        self.layout = layout
        self.meta = dict(meta)

    def probabilities(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            dist = self.policy.get_distribution(torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0))
            return dist.distribution.probs[0].numpy()

    def __call__(self, point: Point) -> int:
        probs = np.where(point.valid, self.probabilities(point.obs), -1.0)
        return int(np.argmax(probs))

    # -- files ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = io.BytesIO()
        torch.save(self.policy.state_dict(), weights)
        meta = {**self.meta, "format": FORMAT, "layout": self.layout.to_json()}
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("meta.json", json.dumps(meta, indent=2, sort_keys=True))
            zf.writestr("policy.pt", weights.getvalue())
        return path

    @staticmethod
    def load(path: str | Path) -> "TrainedModel":
        """A model file (module docstring); a clear error for a missing or foreign one. Torch runs
        it on one thread: the network is small, and the simulator runs seeds in parallel processes."""
        path = Path(path)
        try:
            with zipfile.ZipFile(path) as zf:
                meta = json.loads(zf.read("meta.json"))
                weights = zf.read("policy.pt")
        except FileNotFoundError:
            raise LayoutError(f"{path}: no such model file; train one with python -m simulator.rl_train") from None
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as exc:
            raise LayoutError(f"{path}: not a DeepShare RL model ({exc})") from None
        if meta.get("format") != FORMAT:
            raise LayoutError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        layout = Layout.from_json(meta["layout"])
        torch.set_num_threads(1)
        policy = network(layout, meta["net_arch"])
        try:
            policy.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
        except RuntimeError as exc:
            raise LayoutError(f"{path}: the weights do not fit its layout: {exc}") from None
        return TrainedModel(policy, layout, meta)
