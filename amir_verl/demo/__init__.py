"""The demo on a CPU (:mod:`amir_verl.demo.quickstart`): GRPO, then AMIR-GRPO, through verl's real
``main_ppo`` on the CPU backend, on a toy task (:mod:`~amir_verl.demo.toy_task`: a tiny model, a tokenizer,
data and its reward), and their table and plot (:mod:`~amir_verl.demo.report`)."""
