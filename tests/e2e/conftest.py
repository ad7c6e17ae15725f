"""The toy task's model, tokenizer and data, made once for every end-to-end module (runs only read them)."""

import pytest


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from amir_verl.demo.toy_task import make_assets

    return make_assets(tmp_path_factory.mktemp("toy"), n_train=64, n_test=8)
