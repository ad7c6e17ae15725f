"""Entry point of the ``verl.plugins`` group: verl imports this module in every process that imports verl.

With ``AMIR_VERL_CPU=1`` it first switches the process to the CPU backend (:mod:`amir_verl.cpu`).
It registers, in verl's own registries, the policy-loss modes ``amir_grpo`` / ``amir_gspo``
(:mod:`amir_verl.actor_loss`), the reward-loop manager ``amir_calibrated`` (:mod:`amir_verl.reward.manager`)
and the V1 trainer mode ``amir`` (:mod:`amir_verl.trainer`).

verl swallows plugin import errors at DEBUG level, so a failure here would only show up later as
"Unsupported loss mode"; ``python -m amir_verl.verl_plugin`` imports it loudly to check an install.
"""

import os

if os.environ.get("AMIR_VERL_CPU", "") == "1":  # debug on CPU: explicit opt-in, never on a GPU run
    from amir_verl.cpu import activate_cpu_backend

    activate_cpu_backend()

from amir_verl.run_config import install_early_config_check  # noqa: E402

install_early_config_check()  # AMIR config errors stop main_ppo on the driver, before Ray starts

import amir_verl.actor_loss  # noqa: F401,E402  (registers the policy-loss modes)
import amir_verl.reward.manager  # noqa: F401,E402  (registers reward manager "amir_calibrated")
import amir_verl.trainer  # noqa: F401,E402  (registers trainer mode "amir")

if __name__ == "__main__":
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    print("policy losses:", ", ".join(m for m in POLICY_LOSS_REGISTRY if m.startswith("amir")))
    print("trainer modes:", ", ".join(sorted(TRAINER_REGISTRY)))
