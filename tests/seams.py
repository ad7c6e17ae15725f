"""Fingerprints of upstream verl (and vLLM) source, for the tests that pin the functions amir-verl relies on."""

import hashlib
import inspect


def fingerprint(obj) -> str:
    """sha256 prefix of ``obj``'s source: changes whenever verl edits it."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def module_fingerprint(name: str) -> str:
    """sha256 prefix of module ``name``'s source file, found without importing the module: for modules whose
    import runs the very code a patch relies on (a version lookup at module level)."""
    import importlib.util

    with open(importlib.util.find_spec(name).origin, encoding="utf-8") as source:
        return hashlib.sha256(source.read().encode()).hexdigest()[:16]
