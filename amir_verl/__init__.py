"""amir-verl: AMIR-GRPO and AMIR-GSPO for verl 0.9.1.

The math lives in :mod:`amir_verl.preference` and :mod:`amir_verl.lambda_control` (pure torch); the
verl glue in :mod:`amir_verl.actor_loss` (workers) and :mod:`amir_verl.trainer` (driver), loaded in
every verl process through the ``verl.plugins`` entry point :mod:`amir_verl.verl_plugin`.
"""

__version__ = "0.1.0"
