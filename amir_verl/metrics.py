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
GROUPS_WITHOUT_PAIRS = PREFIX + "groups_without_pairs"
# the actor's (amir_verl.actor_loss returns them under these names; verl's actor logs them under ACTOR). Per
# mini-batch, the value of the term in the loss (summed over micro-batches and ranks): verl's reduce_metrics
# averages a key over the mini-batches and takes the minimum when the name contains "min", so the first two give
# the mean and the smallest share an optimizer step received; the third the fewest paired sequences an optimizer
# step held (a step without one rightly receives no share).
ACTOR = "actor/"
ACTOR_PREF_TERM = "amir_pref_term"  # lambda * (-J_pref) as the actor applied it
ACTOR_PREF_TERM_MIN = "amir_pref_term_min"
ACTOR_PAIRED_SEQUENCES_MIN = "amir_paired_sequences_min"
PREF_TERM, PREF_TERM_MIN, PAIRED_SEQUENCES_MIN = (ACTOR + name for name in (
    ACTOR_PREF_TERM, ACTOR_PREF_TERM_MIN, ACTOR_PAIRED_SEQUENCES_MIN))
# verl's
REWARD = "critic/score/mean"
ROLLOUT_PROBS_DIFF_MAX = "training/rollout_probs_diff_max"  # rollout's log-probs against the actor's
STEP_TIME = "timing_s/step"


def format_value(value: float | None, spec: str = ".3f") -> str:
    """A metric for a table or a console line: "-" when there is none (None, or NaN)."""
    return "-" if value is None or value != value else format(value, spec)
