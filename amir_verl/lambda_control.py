"""The lambda_reg controller of spec section 3 (pure python, no verl import).

The paper adapts lambda multiplicatively "to keep the ratio in a target range"; the official code
uses ``ratio = lambda * L_pref / L_grpo``, which explodes when the on-policy GRPO loss is near zero or
negative (advantages have zero mean) and then drives lambda to its floor. This controller uses the
share of the preference term in the total magnitude, smoothed across optimizer steps:

    rho = EMA(|lambda * L_pref|) / (EMA(|L_pg|) + EMA(|lambda * L_pref|))      in [0, 1]

and multiplies lambda by ``increase_factor`` when rho < target_low, by ``decrease_factor`` when
rho > target_high, clamped to [lambda_min, lambda_max].
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdaptiveLambdaController:
    """Holds lambda_reg and its EMA state. One instance lives on the driver; workers receive lambda."""

    lambda_init: float
    adaptive: bool
    lambda_min: float
    lambda_max: float
    target_low: float
    target_high: float
    increase_factor: float
    decrease_factor: float
    ema_decay: float

    def __post_init__(self) -> None:
        self.value = float(self.lambda_init)
        self.ema_pg: float | None = None
        self.ema_pref: float | None = None
        self.num_updates = 0
        self.last_ratio: float | None = None

    def update(self, pg_loss: float, pref_loss: float, num_pairs: int) -> float:
        """Fold in one optimizer step's losses and return the lambda for the next step.

        ``pref_loss`` is -J_pref (unweighted). A step without pairs carries no information about the
        balance of the two terms, so it leaves the state untouched; so does a fixed lambda.
        """
        if not (math.isfinite(pg_loss) and math.isfinite(pref_loss)):
            raise ValueError(f"lambda controller got a non-finite loss: pg_loss={pg_loss}, pref_loss={pref_loss}")
        if not self.adaptive or num_pairs == 0:
            return self.value
        pg, pref = abs(pg_loss), abs(self.value * pref_loss)
        if self.ema_pg is None:
            self.ema_pg, self.ema_pref = pg, pref
        else:
            d = self.ema_decay
            self.ema_pg = d * self.ema_pg + (1 - d) * pg
            self.ema_pref = d * self.ema_pref + (1 - d) * pref
        self.num_updates += 1
        total = self.ema_pg + self.ema_pref
        if total == 0.0:
            return self.value
        self.last_ratio = self.ema_pref / total
        if self.last_ratio < self.target_low:
            self.value = min(self.lambda_max, self.value * self.increase_factor)
        elif self.last_ratio > self.target_high:
            self.value = max(self.lambda_min, self.value * self.decrease_factor)
        return self.value

    def state_dict(self) -> dict:
        return {
            "value": self.value,
            "ema_pg": self.ema_pg,
            "ema_pref": self.ema_pref,
            "num_updates": self.num_updates,
            "last_ratio": self.last_ratio,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"value", "ema_pg", "ema_pref", "num_updates", "last_ratio"} - set(state)
        if missing:
            raise KeyError(f"lambda controller state is missing {sorted(missing)}")
        self.value = float(state["value"])
        self.ema_pg = state["ema_pg"]
        self.ema_pref = state["ema_pref"]
        self.num_updates = int(state["num_updates"])
        self.last_ratio = state["last_ratio"]
