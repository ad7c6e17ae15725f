"""The tool of the multi-turn end-to-end run (tests/e2e/test_multi_turn_cpu.py), a verl function tool.

verl loads this file by its path (``actor_rollout_ref.rollout.multi_turn.function_tool_path``) in each agent-loop
worker (``AgentLoopWorker.__init__``: ``load_all_tools``), where ``@function_tool`` registers it; verl's
``ToolAgentLoop`` receives it there. Its output uses only characters of the toy tokenizer (one token each).
"""

from verl.tools.function_tool import function_tool


def tool_output(text: str) -> str:
    """What the tool answers for ``text`` (also what the test expects to find in each response)."""
    digits = "".join(c for c in text if c.isdigit())
    return f"saw {digits}." if digits else "saw none."


@function_tool
def read_digits(text: str) -> str:
    """Reads the digits of a text.

    Args:
        text: what the assistant wrote.
    """
    return tool_output(text)
