"""verl glue: the reward-loop manager ``amir_calibrated`` (``reward.reward_manager.name=amir_calibrated``).

verl 0.9.1's ``NaiveRewardManager`` decodes each response and calls a score function; this manager is
that one with :func:`amir_verl.reward.calibrated.compute_score` as the score function and its weights
read from verl's config, ``reward.reward_kwargs.{w_corr, w_fmt, w_calib, math_timeout_s, math_workers}`` (the place
verl's DAPO manager reads its own keys). Importing this module registers it in verl's reward-loop registry;
:mod:`amir_verl.verl_plugin` imports it once verl imports that registry.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial

from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from amir_verl.reward.calibrated import RewardWeights
from amir_verl.reward.calibrated import compute_score as calibrated_score

MANAGER_NAME = "amir_calibrated"


def weights_from_config(config) -> RewardWeights:
    """``reward.reward_kwargs`` of a verl config -> weights; unknown keys there are verl's or another
    manager's and are left alone."""
    kwargs = dict(config.reward.get("reward_kwargs", None) or {}) if config is not None else {}
    known = {f.name for f in fields(RewardWeights)}
    return RewardWeights(**{k: v for k, v in kwargs.items() if k in known})


@register(MANAGER_NAME)
class AmirCalibratedRewardManager(NaiveRewardManager):
    """``naive`` with the calibrated math reward (correctness + format + Brier)."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                 reward_model_tokenizer=None):
        # verl passes its configured score function; this manager is defined by its own
        weights = weights_from_config(config)
        score = partial(calibrated_score, w_corr=weights.w_corr, w_fmt=weights.w_fmt, w_calib=weights.w_calib,
                        math_timeout_s=weights.math_timeout_s, math_workers=weights.math_workers)
        super().__init__(config, tokenizer, score, reward_router_address, reward_model_tokenizer)
