"""docs/troubleshooting.md against the code: each entry's overrides, composed on verl's own config as ``main_ppo``
composes it, stop the driver's checks with exactly the message the page shows; and every ``raise`` of the run checks
(``amir_verl/run_config.py``, ``amir_verl/config.py``) is reached by some entry, so a new refusal without a page entry
fails here, and so does a message whose text changed."""

import ast
import json
import os
import re
import traceback
from pathlib import Path

import pytest

from amir_verl import config as amir_config
from amir_verl import run_config
from tests.support import GRPO, REPO, compose_verl

PAGE = REPO / "docs" / "troubleshooting.md"
CHECKED_MODULES = (run_config, amir_config)
# raise sites that are not a run's config: amir_overrides' own argument check (a caller's bug, not a config)
NOT_CONFIG_ERRORS = {"amir_overrides"}
# this machine has no flash-attn: the examples run with PyTorch's attention, as the page says a user without it does
QUIET_ATTENTION = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
WORKER = "on this worker (host HOST)"  # where the worker's message says it ran, as the page shows it


def entries() -> list[dict]:
    """Each '### ' entry of the page: its title, its verl config, its overrides (after "the AMIR switch + ": the
    documented switch, :func:`amir_verl.run_config.amir_overrides`, first) and the message in its text block."""
    found = []
    for block in re.split(r"^### ", PAGE.read_text(), flags=re.M)[1:]:
        title = block.splitlines()[0].strip()
        overrides = re.search(r"^Overrides: (.+)$", block, re.M)
        message = re.search(r"```text\n(.*?)\n```", block, re.S)
        config = re.search(r"^verl config: `(\w+)`", block, re.M)
        assert overrides and message, f"troubleshooting entry {title!r}: needs an 'Overrides:' line and a text block"
        switch = run_config.amir_overrides() if overrides[1].startswith("the AMIR switch + ") else []
        found.append({"title": title, "overrides": switch + re.findall(r"`([^`]+)`", overrides[1]), "message": message[1],
                      "config": config[1] if config else "ppo_trainer"})
    return found


def write_adapter(folder: Path, rank: int, alpha: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha, "peft_type": "LORA"}))
    return folder


def refusal(entry: dict, tmp_path: Path) -> tuple[str, tuple[str, int]]:
    """The message the driver's checks stop this entry's run with, and where it was raised (file name, line), as on
    a GPU machine: without the CPU backend's switch."""
    assert os.environ.get("AMIR_VERL_CPU", "") != "1", "the page is about GPU runs: run the tests without the switch"
    adapter = write_adapter(tmp_path / "adapter_r8", 8, 16)
    overrides = [o.replace("ADAPTER_R8", str(adapter)) for o in entry["overrides"]]
    quiet = [] if any("attn_implementation" in o for o in overrides) else [QUIET_ATTENTION]
    config = compose_verl(GRPO + quiet + overrides, name=entry["config"])
    try:
        run_config.check_any_run(config)  # the driver's checks, in verl's validate_config
        run_config.check_amir_run(config)
        run_config.check_worker_attention(config.actor_rollout_ref, where=WORKER)  # the actor worker's, before init
    except ValueError as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = str(error).replace(str(adapter), "ADAPTER_R8")
        return message, (Path(frame.filename).name, frame.lineno)
    pytest.fail(f"troubleshooting entry {entry['title']!r}: its overrides were not refused")


def raise_sites() -> set[tuple[str, int]]:
    """Every `raise` in the checked modules, outside NOT_CONFIG_ERRORS, as (file name, line)."""
    sites = set()
    for module in CHECKED_MODULES:
        path = Path(module.__file__)
        tree = ast.parse(path.read_text())
        skipped = {n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in NOT_CONFIG_ERRORS
                   for n in ast.walk(f)}
        sites |= {(path.name, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Raise) and n not in skipped}
    return sites


@pytest.mark.parametrize("entry", entries(), ids=lambda e: e["title"])
def test_each_entry_is_refused_with_the_message_the_page_shows(entry, tmp_path):
    message, site = refusal(entry, tmp_path)
    assert message == entry["message"], f"the plugin says\n{message}\nthe page shows\n{entry['message']}"
    assert "\n" not in message  # one line
    assert site in raise_sites()  # so without this entry, the check below would name its raise as missing


def test_every_refusal_of_the_run_checks_has_an_entry(tmp_path):
    reached = {refusal(entry, tmp_path / str(i))[1] for i, entry in enumerate(entries())}
    missing = raise_sites() - reached
    assert not missing, f"raise sites no docs/troubleshooting.md entry reaches: {sorted(missing)}"
