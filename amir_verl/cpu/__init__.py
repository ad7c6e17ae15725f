"""Debug on CPU: verl's real ``main_ppo`` without an accelerator (opt-in with ``AMIR_VERL_CPU=1``).

:mod:`amir_verl.cpu.platform` registers a ``cpu`` platform in verl; :mod:`amir_verl.cpu.hf_rollout` adds
the ``hf`` rollout backend (batched transformers decoding); :mod:`amir_verl.cpu.toy_task` makes the tiny
model, tokenizer and data of the quickstart (:mod:`amir_verl.cpu.quickstart`, the GRPO vs AMIR-GRPO demo),
which launches main_ppo through :mod:`amir_verl.cpu.launch` and reports with :mod:`amir_verl.cpu.report`.
The plugin imports none of this unless the switch is set, so a GPU run never touches it.
"""

SWITCH = "AMIR_VERL_CPU"


def activate_cpu_backend() -> None:
    from amir_verl.cpu import hf_rollout
    from amir_verl.cpu.platform import activate

    activate()
    hf_rollout.register()
