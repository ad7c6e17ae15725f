"""Mean response log-probs of a run's samples under a model, optionally kept in a cache folder (``amir-eval margin``
and ``perplexity`` score the same responses under the same models; with ``--score-cache DIR`` the second
command reuses the first's scores).

A cached score is keyed by what determines it: the model folder's content (every file's path and bytes, the
LoRA adapter of a verl-merged folder included), the dtype and device it was scored in, and the exact prompt
and response text. Anything else is scored again; nothing is reused by name or date.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from amir_verl.evaluation.passk import Sample

CHUNK = 1 << 24


def mean_token_log_probs(model, encoded: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int,
                         pad: int = 0, progress: Callable[[str], None] | None = None) -> list[float]:
    """Mean log-prob per token of each (prompt ids, response ids)'s response given its prompt, temperature 1; NaN for
    an empty response. The model runs on its own device.

    Scored ``batch_size`` sequences per forward pass, sorted by length and left-padded to ``[batch, longest]``
    with an attention mask and position ids counted from each sequence's first token, so that padding changes
    nothing and every sequence ends at the last position: the logits of the last (longest response + 1) positions
    predict every response token, and only those are computed (a real vocabulary's logits over whole sequences
    are GBs)."""
    import torch

    device = next(model.parameters()).device
    scores = [math.nan] * len(encoded)
    order = sorted((i for i, (_, r) in enumerate(encoded) if len(r)), key=lambda i: len(encoded[i][0]) + len(encoded[i][1]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        sequences = [list(encoded[i][0]) + list(encoded[i][1]) for i in rows]
        width, keep = max(map(len, sequences)), max(len(encoded[i][1]) for i in rows) + 1
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, sequence in enumerate(sequences):
            ids[k, width - len(sequence):] = torch.tensor(sequence)
            mask[k, width - len(sequence):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                           logits_to_keep=keep).logits.float()
        # the kept window is positions width-keep .. width-1; position t predicts the token at t + 1
        token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, width - keep + 1:, None].to(device)).squeeze(-1)
        for k, i in enumerate(rows):
            scores[i] = float(token[k, -len(encoded[i][1]):].mean())
        if progress and (start // batch_size + 1) % 10 == 0:
            progress(f"scored {start + len(rows)}/{len(order)} responses")
    return scores


def model_fingerprint(path: str) -> str:
    """sha256 over a model folder's files (sorted relative paths and contents); a hub id or other
    non-folder is taken as its name."""
    folder = Path(path)
    digest = hashlib.sha256()
    if not folder.is_dir():
        digest.update(f"name:{path}".encode())
        return digest.hexdigest()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def sample_key(prompt: str, response: str) -> str:
    return hashlib.sha256(json.dumps([prompt, response]).encode()).hexdigest()


def response_scores(samples: Sequence[Sample], model_path: str, score: Callable[[list[tuple[str, str]]], list[float]],
                    cache: Path | None = None, dtype: str = "float32", device: str = "cpu") -> tuple[list[float], int]:
    """Each sample's mean response log-prob (NaN for an empty response), ``score`` computing those of a list of
    (prompt, response) pairs; returns (scores, how many came from ``cache``). New scores are added to it."""
    pairs = [(s.prompt, s.response) for s in samples]
    keys = [sample_key(*pair) for pair in pairs]
    path = None
    known: dict[str, float] = {}
    if cache is not None:
        path = Path(cache) / f"{model_fingerprint(model_path)}_{dtype}_{device}.json"
        if path.is_file():
            known = {k: float(v) for k, v in json.loads(path.read_text()).items()}  # JSON keeps NaN as NaN
    missing = list(dict.fromkeys(k for k in keys if k not in known))
    if missing:
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        known.update(zip(missing, score([pairs[first[k]] for k in missing]), strict=True))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".tmp")
            partial.write_text(json.dumps(known))
            partial.replace(path)  # a reader never sees half a file
    return [known[k] for k in keys], sum(k not in missing for k in keys)
