"""Say, per benchmark, how many prompts verl's ``filter_overlong_prompts`` dropped.

verl's ``RLHFDataset.maybe_filter_out_long_prompts`` drops every prompt longer than ``data.max_prompt_length``
tokens and prints only the total left (``filter dataset len: N``) of all files together. With seven
evaluation sets in one validation dataset, a Table 1 figure could silently be over fewer problems. The plugin
wraps that method (a post-import hook on ``verl.utils.dataset.rl_dataset``, in every process that builds a
dataset: the driver, for train and validation data) to print one line per data source after verl's own:

    [amir-verl] filter_overlong_prompts: openai/gsm8k: dropped 2 of 1319 prompts longer than 1024 tokens

The data is unchanged; only the line is added. ``tests/test_verl_seams.py`` pins the wrapped method.
"""

from __future__ import annotations

from collections import Counter

import wrapt

PREFIX = "[amir-verl] filter_overlong_prompts"


def dropped_prompt_lines(before: Counter, after: Counter, max_prompt_length: int) -> list[str]:
    """One line per data source of ``before`` (prompts per source before the filter; ``after``: kept)."""
    return [f"{PREFIX}: {source}: dropped {before[source] - after.get(source, 0)} of {before[source]} prompts "
            f"longer than {max_prompt_length} tokens" for source in sorted(before)]


def _report_dropped_prompts(wrapped, instance, args, kwargs):
    dataframe = args[0] if args else kwargs.get("dataframe")
    counted = (getattr(instance, "filter_overlong_prompts", False) and dataframe is not None
               and "data_source" in dataframe.column_names)
    before = Counter(dataframe["data_source"]) if counted else None
    kept = wrapped(*args, **kwargs)
    if counted:
        for line in dropped_prompt_lines(before, Counter(kept["data_source"]), instance.max_prompt_length):
            print(line, flush=True)
    return kept


def install(rl_dataset_module) -> None:
    """Wrap ``RLHFDataset.maybe_filter_out_long_prompts`` of the imported verl module (once)."""
    method = rl_dataset_module.RLHFDataset.maybe_filter_out_long_prompts
    if not isinstance(method, wrapt.FunctionWrapper):
        wrapt.wrap_function_wrapper(rl_dataset_module, "RLHFDataset.maybe_filter_out_long_prompts",
                                    _report_dropped_prompts)
