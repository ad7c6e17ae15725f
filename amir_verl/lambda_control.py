"""The lambda_reg controller (pure python, no verl or torch import).

Each step, before the actor update, the driver measures the two terms at the policy the update
starts from (:class:`StepSignal`, computed by :func:`amir_verl.step_batch.gradient_signal`) and the
controller picks the lambda that this step's update uses. Three rules (``amir.lambda_rule``):

``grad_share`` (default)
    rho = ||dL_pref/dlogp|| / (||dL_pg/dlogp|| + ||dL_pref/dlogp||), the share of the preference
    term in the gradient with respect to the response tokens' log-probabilities (L2 over all response
    tokens of the step batch, L_pref = lambda * (-J_pref)). Unlike the value of L_pg, which on-policy
    is about the covariance of advantage and length and often ~0 or negative, this measures how hard
    each term pushes.
``loss_ratio``
    the official code's rule: r = lambda * L_pref / max(1e-9, L_pg), no smoothing. On-policy L_pg is
    ~0 or negative, so r is huge and lambda falls to its floor within a few steps; kept to reproduce
    the official runs.
``fixed``
    lambda stays at ``lambda_init``.

Both adaptive rules then apply the paper's multiplicative step, as the official code does: the signal
is evaluated at the current lambda; below ``target_low`` lambda is multiplied by ``increase``, above
``target_high`` by ``decrease``, clamped to [``lambda_min``, ``lambda_max``]; the new value is the one
this step's update uses. A step without pairs carries no information about the balance and leaves
lambda alone (the official code returns the GRPO loss alone there).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LAMBDA_RULES = ("grad_share", "loss_ratio", "fixed")
# The official code's floor on the denominator of its ratio (Train/trainer.py, compute_loss).
LOSS_RATIO_EPS = 1e-9


@dataclass(frozen=True)
class LambdaRule:
    """A rule and its constants, as resolved from the ``amir`` config."""

    rule: str
    lambda_init: float
    lambda_min: float
    lambda_max: float
    target_low: float
    target_high: float
    increase: float
    decrease: float

    def __post_init__(self) -> None:
        if self.rule not in LAMBDA_RULES:
            raise ValueError(f"lambda rule must be one of {LAMBDA_RULES}, got {self.rule!r}")


@dataclass(frozen=True)
class StepSignal:
    """What one step batch says about the balance of the two terms, at the start of the update.

    pg_loss: value of the base policy loss over the whole step batch (verl's registered function).
    pref_loss: -J_pref (unweighted).
    pg_grad_norm: ||dL_pg/dlogp|| over all response tokens.
    pref_grad_norm_per_lambda: ||d(-J_pref)/dlogp||, so that lambda * this is ||dL_pref/dlogp||.
    num_pairs: mined pairs of the step.
    """

    pg_loss: float
    pref_loss: float
    pg_grad_norm: float
    pref_grad_norm_per_lambda: float
    num_pairs: int

    def __post_init__(self) -> None:
        for name in ("pg_loss", "pref_loss", "pg_grad_norm", "pref_grad_norm_per_lambda"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"lambda controller got a non-finite {name}: {getattr(self, name)}")

    def grad_share(self, lambda_reg: float) -> float:
        """rho at ``lambda_reg``, in [0, 1]; 0 when both gradients vanish."""
        pref = lambda_reg * self.pref_grad_norm_per_lambda
        total = self.pg_grad_norm + pref
        return pref / total if total > 0 else 0.0

    def loss_ratio(self, lambda_reg: float) -> float:
        """The official r = lambda * L_pref / max(1e-9, L_pg)."""
        return lambda_reg * self.pref_loss / max(LOSS_RATIO_EPS, self.pg_loss)


class LambdaController:
    """Holds lambda_reg on the driver (one value for every rank); workers receive it per step."""

    def __init__(self, rule: LambdaRule):
        self.rule = rule
        self.value = float(rule.lambda_init)
        self.num_updates = 0
        self.last_signal: float | None = None  # the rule's rho or r at the lambda it started the step with

    def step(self, signal: StepSignal) -> float:
        """Fold in one step's signal and return the lambda this step's update uses."""
        r = self.rule
        if r.rule == "fixed" or signal.num_pairs == 0:
            return self.value
        measured = signal.grad_share(self.value) if r.rule == "grad_share" else signal.loss_ratio(self.value)
        if measured < r.target_low:
            self.value = min(r.lambda_max, self.value * r.increase)
        elif measured > r.target_high:
            self.value = max(r.lambda_min, self.value * r.decrease)
        self.last_signal = measured
        self.num_updates += 1
        return self.value

    def state_dict(self) -> dict:
        return {"rule": asdict(self.rule), "value": self.value, "num_updates": self.num_updates,
                "last_signal": self.last_signal}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved state. A checkpoint of another rule or other constants is refused: resuming it
        would silently continue a different controller."""
        missing = {"rule", "value", "num_updates", "last_signal"} - set(state)
        if missing:
            raise KeyError(f"lambda controller state is missing {sorted(missing)}")
        saved = LambdaRule(**state["rule"])
        if saved != self.rule:
            raise ValueError(f"the checkpoint's lambda rule {saved} differs from this run's {self.rule}")
        self.value = float(state["value"])
        self.num_updates = int(state["num_updates"])
        self.last_signal = state["last_signal"]
