"""The names of the metrics AMIR logs through verl's logger, and of verl's own that the reports read: the
public contract, defined once (the trainer logs under these names; the reports and the tests read them).

Each step's ``amir/*`` metrics are the pair statistics (:class:`amir_verl.preference.PreferenceStats`, under
:data:`PREFIX`) and the lambda controller's (:attr:`amir_verl.step_batch.DriverStep.metrics`).
"""

PREFIX = "amir/"
# pair statistics (PreferenceStats' fields under PREFIX)
PREF_LOSS = PREFIX + "pref_loss"  # -J_pref
NUM_PAIRS = PREFIX + "num_pairs"
PAIR_ACCURACY = PREFIX + "pair_accuracy"
MARGIN = PREFIX + "margin"
# the lambda controller, at the lambda the step's update uses
LAMBDA = PREFIX + "lambda"
GRAD_SHARE = PREFIX + "grad_share"  # the default lambda rule's signal: the preference term's share of the gradient
PG_GRAD_NORM = PREFIX + "pg_grad_norm"
PREF_GRAD_NORM = PREFIX + "pref_grad_norm"
LOSS_RATIO = PREFIX + "loss_ratio"
# the actor's (amir_verl.actor_loss)
PREF_TERM = "actor/amir_pref_term"  # lambda * (-J_pref) as the actor applied it
# verl's
REWARD = "critic/score/mean"
STEP_TIME = "timing_s/step"


def format_value(value: float | None, spec: str = ".3f") -> str:
    """A metric for a table or a console line: "-" when there is none (None, or NaN)."""
    return "-" if value is None or value != value else format(value, spec)
