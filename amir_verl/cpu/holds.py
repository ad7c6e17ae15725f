"""A test-only switch of the CPU backend's rollouts: make a weight sync cut responses by construction, not by timing.

:data:`HOLD_ENV` = ``"<requests>@<tokens>"``: under the weights a run starts from, the first ``<requests>``
requests that reach their ``<tokens>``-th response token while still decoding stop there and wait for the next
abort, which answers them "aborted" with those tokens; verl's async client then resumes them under the next
weights (a partial rollout). The ``hf`` server (:mod:`amir_verl.cpu.hf_rollout`) holds under version 0, so never
in a resumed run; vLLM's scheduler (:mod:`amir_verl.cpu.vllm_engine`), which knows no versions, until the engine's
first abort. A run needs more prompts in flight than its first step trains on (verl's warm-up batch does that), or
its first step waits forever for a held group; validation before the first abort would wait likewise.
"""

from __future__ import annotations

HOLD_ENV = "AMIR_VERL_HOLD"


def parse_hold(value: str | None) -> tuple[int, int]:
    """:data:`HOLD_ENV`'s value -> (requests to hold, the token count they stop at); (0, 0) when unset."""
    if not value:
        return 0, 0
    try:
        requests, tokens = (int(part) for part in value.split("@"))
    except ValueError:
        raise ValueError(f"{HOLD_ENV}={value!r}: expected '<requests>@<tokens>', e.g. '4@2'") from None
    if requests < 0 or tokens < 1:
        raise ValueError(f"{HOLD_ENV}={value!r}: requests must be >= 0 and tokens >= 1")
    return requests, tokens
