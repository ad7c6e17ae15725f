"""The ``amir`` config namespace: every AMIR hyper-parameter, its default and its check (no verl import).

The defaults here are the only ones: ``recipes/config/amir_trainer.yaml`` repeats them for hydra
(a test keeps the two equal) and the README table is generated from :func:`describe_keys`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from amir_verl.lambda_control import AdaptiveLambdaController
from amir_verl.preference import PAIR_MODES

REFERENCE_MODES = ("ref", "ref_free")
CONFIG_NAMESPACE = "amir"


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
    lambda_init: float = field(default=0.01, metadata={"doc": "lambda_reg at step 1"})
    lambda_adaptive: bool = field(default=True, metadata={"doc": "adapt lambda (spec section 3); false = fixed"})
    lambda_min: float = field(default=0.005, metadata={"doc": "lower clamp of the adaptive lambda"})
    lambda_max: float = field(default=0.05, metadata={"doc": "upper clamp of the adaptive lambda"})
    target_ratio_low: float = field(default=0.30, metadata={"doc": "raise lambda while rho is below this"})
    target_ratio_high: float = field(default=0.70, metadata={"doc": "lower lambda while rho is above this"})
    lambda_increase: float = field(default=1.25, metadata={"doc": "multiplier when rho < target_ratio_low"})
    lambda_decrease: float = field(default=0.8, metadata={"doc": "multiplier when rho > target_ratio_high"})
    ratio_ema_decay: float = field(default=0.9, metadata={"doc": "EMA decay of the magnitudes of L_pg and lambda * L_pref"})

    def __post_init__(self) -> None:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"{CONFIG_NAMESPACE}.{key}={getattr(self, key)!r}: {why}")

        for key in ("beta_dpo", "delta_r", "lambda_init", "lambda_min", "lambda_max", "target_ratio_low",
                    "target_ratio_high", "lambda_increase", "lambda_decrease", "ratio_ema_decay"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
                float("inf"), float("-inf")
            ):
                fail(key, "must be a finite number")
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
        if not isinstance(self.lambda_adaptive, bool):
            fail("lambda_adaptive", "must be true or false")
        if self.lambda_init < 0:
            fail("lambda_init", "must be >= 0")
        if self.lambda_adaptive:
            if not 0 < self.lambda_min <= self.lambda_max:
                fail("lambda_min", f"must satisfy 0 < lambda_min <= lambda_max ({self.lambda_max})")
            if not self.lambda_min <= self.lambda_init <= self.lambda_max:
                fail("lambda_init", f"must lie in [lambda_min, lambda_max] = [{self.lambda_min}, {self.lambda_max}]")
            if not 0 <= self.target_ratio_low < self.target_ratio_high <= 1:
                fail("target_ratio_low", f"must satisfy 0 <= low < high ({self.target_ratio_high}) <= 1")
            if self.lambda_increase <= 1:
                fail("lambda_increase", "must be > 1")
            if not 0 < self.lambda_decrease < 1:
                fail("lambda_decrease", "must be in (0, 1)")
            if not 0 <= self.ratio_ema_decay < 1:
                fail("ratio_ema_decay", "must be in [0, 1)")

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
            if f.name in values and f.type == "float" and isinstance(values[f.name], int) and not isinstance(
                values[f.name], bool
            ):
                values[f.name] = float(values[f.name])
        return cls(**values)

    @property
    def reference_free(self) -> bool:
        return self.reference == "ref_free"

    def make_lambda_controller(self) -> AdaptiveLambdaController:
        return AdaptiveLambdaController(
            lambda_init=self.lambda_init,
            adaptive=self.lambda_adaptive,
            lambda_min=self.lambda_min,
            lambda_max=self.lambda_max,
            target_low=self.target_ratio_low,
            target_high=self.target_ratio_high,
            increase_factor=self.lambda_increase,
            decrease_factor=self.lambda_decrease,
            ema_decay=self.ratio_ema_decay,
        )


def describe_keys() -> list[tuple[str, object, str]]:
    """(key, default, description) for every AMIR key, in declaration order."""
    return [(f"{CONFIG_NAMESPACE}.{f.name}", f.default, f.metadata["doc"]) for f in fields(AmirConfig)]
