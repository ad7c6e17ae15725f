"""Fingerprints of upstream verl source, for the tests that pin the functions amir-verl relies on."""

import hashlib
import inspect


def fingerprint(obj) -> str:
    """sha256 prefix of ``obj``'s source: changes whenever verl edits it."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
