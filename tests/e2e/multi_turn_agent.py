"""verl's own ``ToolAgentLoop``, made to run two model turns with a tool call between them on the toy model
(tests/e2e/test_multi_turn_cpu.py).

verl 0.9.1 runs agent loops in its agent-loop worker processes (``AgentLoopWorkerTQ``, Ray actors): each sample's
``agent_name`` (the dataset's column, else ``rollout.agent.default_agent_loop``) is looked up in that process's
``_agent_loop_registry`` and the entry is built with ``hydra.utils.instantiate``. A class's ``@register`` only
fills the registry of a process that imports its module, and nothing imports a user's module there; the seam
that works is ``rollout.agent.agent_loop_config_path``: a YAML list of ``{name, _target_, ...}`` that each worker
loads into its registry (``AgentLoopWorker.__init__``), whose ``_target_`` hydra then imports by its dotted
path in the worker. So this module must be importable in Ray's worker processes: the run puts the repository on
``PYTHONPATH`` (as the probe does, :func:`tests.e2e.probe.probed`), and Ray's workers inherit it.

Two pieces adapt ``ToolAgentLoop`` to a model that cannot write a tool call (the toy tokenizer has no ``<``,
``{`` or ``"``, so verl's parsers never find one):

- :class:`EveryTurnCallsTheTool`, a verl ``ToolParser`` (``multi_turn.format=amir_toy``, registered on import,
  before the loop's ``__init__`` looks it up): every assistant turn calls the tool ``read_digits`` with the
  turn's text;
- :class:`TurnCappedToolAgentLoop`: each assistant turn gets at most ``turn_tokens`` new tokens
  (``max_tokens``; verl's loop sends none, so the first turn of a model that never stops would fill the whole
  response and leave no room for the tool).

Everything else is verl's: the state machine, the tool call (the function tool of
``tests/e2e/multi_turn_tool.py``, through ``multi_turn.function_tool_path``), the Continuous Token merges
that append the tool's message and the next generation prompt with ``response_mask`` 0, and the rollout
log-probs aligned with them (0.0 on the tool's tokens). ``multi_turn.max_assistant_turns=2`` ends each
trajectory after the second turn.

This module must not import ``tests/e2e/multi_turn_tool.py``: verl loads that file by path, and a second import
would register its tool twice.
"""

from __future__ import annotations

import json
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

PARSER = "amir_toy"
TOOL = "read_digits"


@ToolParser.register(PARSER)
class EveryTurnCallsTheTool(ToolParser):
    """Reads every assistant turn as a call of the tool with the turn's text."""

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name=TOOL, arguments=json.dumps({"text": text}))]


class TurnCappedToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with at most ``turn_tokens`` new tokens per assistant turn."""

    def __init__(self, *args, turn_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn_tokens = int(turn_tokens)

    async def _handle_generating_state(self, agent_data, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        left = self.response_length - len(agent_data.response_mask)
        capped = {**sampling_params, "max_tokens": max(1, min(self.turn_tokens, left))}
        return await super()._handle_generating_state(agent_data, capped, ignore_termination)
