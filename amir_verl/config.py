"""The ``amir`` config namespace: every AMIR hyper-parameter, its default and its check (no verl import).

The defaults here are the only ones: ``recipes/config/amir_trainer.yaml`` repeats them for hydra
and the key table of docs/usage.md, written by hand, repeats :func:`describe_keys`; tests/test_config.py checks
that both stay equal to the dataclass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from amir_verl.lambda_control import LAMBDA_RULES, LambdaController, LambdaRule
from amir_verl.preference import PAIR_MODES

REFERENCE_MODES = ("ref", "ref_free")
CONFIG_NAMESPACE = "amir"

# The keys whose null means "this rule's default". loss_ratio: the official code's constants
# (AMIR-GRPO Train/trainer.py: lambda 0.01 in [0.005, 0.05], band 0.30-0.70). grad_share: chosen from
# the measured share against lambda on the CPU toy task (docs/method.md, "Adaptive lambda").
RULE_KEYS = ("lambda_init", "lambda_min", "lambda_max", "target_ratio_low", "target_ratio_high")
RULE_DEFAULTS = {
    "grad_share": {"lambda_init": 0.5, "lambda_min": 0.05, "lambda_max": 5.0,
                   "target_ratio_low": 0.1, "target_ratio_high": 0.3},
    "loss_ratio": {"lambda_init": 0.01, "lambda_min": 0.005, "lambda_max": 0.05,
                   "target_ratio_low": 0.30, "target_ratio_high": 0.70},
    "fixed": {"lambda_init": 0.01, "lambda_min": None, "lambda_max": None,
              "target_ratio_low": None, "target_ratio_high": None},
}


@dataclass(frozen=True)
class AmirConfig:
    beta_dpo: float = field(default=0.2, metadata={"doc": "beta of the DPO logit z (official run: 0.2)"})
    delta_r: float = field(
        default=0.5,
        metadata={
            "doc": "strict reward margin: i is preferred over j when r_i - r_j > delta_r. 0.5 with the default "
            "reward weights (correctness 1.0, format + calibration below 0.5) means a pair needs a "
            "correctness difference, the effect of the official 2.0 on its 0-3.9 scale"
        },
    )
    pair_mode: str = field(default="all", metadata={"doc": "`all` qualifying ordered pairs, or `best_vs_rest`"})
    max_pairs_per_group: int | None = field(
        default=None, metadata={"doc": "cap per group keeping the largest reward gaps; null = no cap"}
    )
    reference: str = field(
        default="ref",
        metadata={
            "doc": "`ref`: l_ref from verl's reference policy (needs reference log-probs); "
            "`ref_free`: l_ref = 0 (the official run)"
        },
    )
    lambda_rule: str = field(
        default="grad_share",
        metadata={
            "doc": "`grad_share`: adapt lambda to the preference term's share of the log-prob gradient; "
            "`loss_ratio`: the official code's rule on lambda * L_pref / L_pg (falls to its floor "
            "on-policy, for reproducing the official runs); `fixed`: lambda_init throughout"
        },
    )
    lambda_init: float | None = field(
        default=None,
        metadata={"doc": "lambda before the rule's first adjustment (fixed: throughout); null = the rule's default"},
    )
    lambda_min: float | None = field(default=None, metadata={"doc": "lower clamp; null = the rule's default"})
    lambda_max: float | None = field(default=None, metadata={"doc": "upper clamp; null = the rule's default"})
    target_ratio_low: float | None = field(
        default=None, metadata={"doc": "raise lambda while the rule's signal is below this; null = the rule's default"}
    )
    target_ratio_high: float | None = field(
        default=None, metadata={"doc": "lower lambda while the rule's signal is above this; null = the rule's default"}
    )
    lambda_increase: float = field(default=1.25, metadata={"doc": "multiplier when the signal < target_ratio_low"})
    lambda_decrease: float = field(default=0.8, metadata={"doc": "multiplier when the signal > target_ratio_high"})
    base_loss_mode: str | None = field(
        default=None,
        metadata={
            "doc": "verl policy loss under `loss_mode=amir` (vanilla, gspo, cispo, sapo, gpg, dppo_tv, ...); "
            "null with the aliases `amir_grpo` (= vanilla) and `amir_gspo` (= gspo)"
        },
    )

    def __post_init__(self) -> None:
        def fail(key: str, why: str, value: object = None) -> None:
            shown = getattr(self, key) if value is None else value
            raise ValueError(f"{CONFIG_NAMESPACE}.{key}={shown!r}: {why}")

        for key in ("beta_dpo", "delta_r", "lambda_init", "lambda_min", "lambda_max", "target_ratio_low",
                    "target_ratio_high", "lambda_increase", "lambda_decrease"):
            value = getattr(self, key)
            if value is None and key in RULE_KEYS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(key, "must be a finite number" + (" or null" if key in RULE_KEYS else ""))
        if self.beta_dpo <= 0:
            fail("beta_dpo", "must be > 0")
        if self.delta_r < 0:
            fail("delta_r", "must be >= 0 (the margin is strict, so 0 pairs any two different rewards)")
        if self.pair_mode not in PAIR_MODES:
            fail("pair_mode", f"must be one of {PAIR_MODES}")
        if self.max_pairs_per_group is not None and (
            isinstance(self.max_pairs_per_group, bool)
            or not isinstance(self.max_pairs_per_group, int)
            or self.max_pairs_per_group < 1
        ):
            fail("max_pairs_per_group", "must be a positive integer or null")
        if self.reference not in REFERENCE_MODES:
            fail("reference", f"must be one of {REFERENCE_MODES}")
        if self.base_loss_mode is not None and not isinstance(self.base_loss_mode, str):
            fail("base_loss_mode", "must be the name of a verl policy loss or null")
        if self.lambda_rule not in LAMBDA_RULES:
            fail("lambda_rule", f"must be one of {LAMBDA_RULES}")
        rule = self.lambda_settings()
        if rule.lambda_init < 0:
            fail("lambda_init", "must be >= 0", rule.lambda_init)
        if rule.rule == "fixed":
            return
        if not 0 < rule.lambda_min <= rule.lambda_max:
            fail("lambda_min", f"must satisfy 0 < lambda_min <= lambda_max ({rule.lambda_max})", rule.lambda_min)
        if not rule.lambda_min <= rule.lambda_init <= rule.lambda_max:
            fail("lambda_init", f"must lie in [lambda_min, lambda_max] = [{rule.lambda_min}, {rule.lambda_max}]",
                 rule.lambda_init)
        if not 0 <= rule.target_low < rule.target_high:
            fail("target_ratio_low", f"must satisfy 0 <= low < high ({rule.target_high})", rule.target_low)
        if rule.rule == "grad_share" and rule.target_high > 1:
            fail("target_ratio_high", "a gradient share is at most 1", rule.target_high)
        if self.lambda_increase <= 1:
            fail("lambda_increase", "must be > 1")
        if not 0 < self.lambda_decrease < 1:
            fail("lambda_decrease", "must be in (0, 1)")

    def lambda_settings(self) -> LambdaRule:
        """The lambda rule with every null key replaced by the rule's default (:data:`RULE_DEFAULTS`)."""
        defaults = RULE_DEFAULTS[self.lambda_rule]
        value = {key: defaults[key] if getattr(self, key) is None else getattr(self, key) for key in RULE_KEYS}
        return LambdaRule(
            rule=self.lambda_rule,
            lambda_init=value["lambda_init"],
            lambda_min=value["lambda_min"],
            lambda_max=value["lambda_max"],
            target_low=value["target_ratio_low"],
            target_high=value["target_ratio_high"],
            increase=self.lambda_increase,
            decrease=self.lambda_decrease,
        )

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> AmirConfig:
        """Build from the ``amir`` block of a verl config (a dict or DictConfig); None = all defaults."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown AMIR config key(s) {', '.join(CONFIG_NAMESPACE + '.' + k for k in unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
        # Hydra parses `1` as int; accept ints for float keys, reject strings with the key in the message.
        for f in fields(cls):
            if f.name in values and f.type.startswith("float") and isinstance(values[f.name], int) and not isinstance(
                values[f.name], bool
            ):
                values[f.name] = float(values[f.name])
        return cls(**values)

    @property
    def reference_free(self) -> bool:
        return self.reference == "ref_free"

    def make_lambda_controller(self) -> LambdaController:
        return LambdaController(self.lambda_settings())


def describe_keys() -> list[tuple[str, object, str]]:
    """(key, default, description) for every AMIR key, in declaration order."""
    return [(f"{CONFIG_NAMESPACE}.{f.name}", f.default, f.metadata["doc"]) for f in fields(AmirConfig)]
