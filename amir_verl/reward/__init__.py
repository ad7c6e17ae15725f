"""The calibrated math reward (the paper's section 3.2): prompt template, answer checks, score function.

``reward.custom_reward_function.path=pkg://amir_verl.reward`` with ``name=compute_score``, or the
reward-loop manager ``reward.reward_manager.name=amir_calibrated`` (:mod:`amir_verl.reward.manager`).
"""

from amir_verl.reward.calibrated import RewardWeights, compute_score
from amir_verl.reward.template import build_prompt, parse_response

__all__ = ["RewardWeights", "build_prompt", "compute_score", "parse_response"]
