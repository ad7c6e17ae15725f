"""benchmarks/gpu_install_check.py's pure helpers, offline (the script itself needs PyPI: not run here), and the
GPU install sequence it checks: README.md's ``# GPU`` line, the same commands in docs/install.md and
docs/benchmarks.md."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from tests.support import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gic():
    return load_script(ROOT / "benchmarks" / "gpu_install_check.py")


def test_the_readme_gpu_line_is_three_pip_installs_torch_first_flash_attn_unisolated(gic):
    step1, step2, step3 = gic.readme_sequence((ROOT / "README.md").read_text())
    assert all(argv[:2] == ["pip", "install"] for argv in (step1, step2, step3))
    assert gic.requirements_of(step1)[0] == "torch==2.11.0"
    assert gic.requirements_of(step2) == ["flash-attn==2.8.3"] and "--no-build-isolation" in step2
    assert gic.requirements_of(step3) == ["-e", ".[gpu]"]
    for doc in ("docs/install.md", "docs/benchmarks.md"):  # the docs give the same commands
        documented = gic.documented_commands((ROOT / doc).read_text())
        assert all(argv in documented for argv in (step1, step2, step3)), doc


def test_sequence_parsing(gic):
    readme = "```bash\npip install -e .   # CPU\npip install torch==2.11.0 psutil && pip install flash-attn==2.8.3 " \
             "--no-build-isolation && pip install -e \".[gpu]\"   # GPU\n```\n"
    assert gic.readme_sequence(readme) == [["pip", "install", "torch==2.11.0", "psutil"],
                                           ["pip", "install", "flash-attn==2.8.3", "--no-build-isolation"],
                                           ["pip", "install", "-e", ".[gpu]"]]
    with pytest.raises(ValueError):
        gic.readme_sequence("pip install -e .  # CPU\n")
    assert gic.requirements_of(["pip", "install", "-U", "-c", "c.txt", "a==1", "--editable", "./x[y]", "b"]) == \
        ["a==1", "-e", "./x[y]", "b"]
    assert gic.unpinned(["pip", "install", "flash-attn==2.8.3", "--no-build-isolation"]) == \
        ["pip", "install", "flash-attn", "--no-build-isolation"]


def test_flash_attn_readme_and_setup_py_reading(gic):
    readme = ("**Requirements:**\n- CUDA toolkit or ROCm toolkit\n"
              "- `packaging` Python package (`pip install packaging`)\n"
              "- `ninja` Python package (`pip install ninja`) *\n"
              "```sh\npip install flash-attn --no-build-isolation\n```\n"
              "```sh\nMAX_JOBS=4 pip install flash-attn --no-build-isolation\n```\n"
              "```sh\npip install triton==3.2.0\n```\n")
    assert gic.readme_python_packages(readme) == {"packaging", "ninja"}
    assert gic.documented_commands(readme) == [["pip", "install", "flash-attn", "--no-build-isolation"],
                                               ["pip", "install", "triton==3.2.0"]]
    setup_py = ("import os, sys\nfrom packaging.version import parse\nfrom setuptools import setup\n"
                "from wheel.bdist_wheel import bdist_wheel\nimport torch\nfrom torch.utils.cpp_extension import X\n"
                "from . import local\nclass B:\n    def __init__(self):\n        import psutil\n")
    assert gic.imported_modules(setup_py, top_level_only=True) == {"packaging", "setuptools", "wheel", "torch"}
    assert gic.imported_modules(setup_py) == {"packaging", "setuptools", "wheel", "torch", "psutil"}


def test_torch_cuda_and_the_wheel_flash_attn_guesses(gic):
    requires = ["filelock", 'cuda-toolkit[cublas,cudart]==13.0.2; platform_system == "Linux"', "triton==3.6.0"]
    assert gic.cuda_of_torch(requires) == "13.0"
    assert gic.cuda_of_torch(["nvidia-cublas-cu12==12.8.4.1"]) is None
    assert gic.flash_attn_wheel_guess("2.8.3", "2.11.0", "13.0", "cp312") == \
        "flash_attn-2.8.3+cu12torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"


def test_report_and_output_parsing(gic):
    report = json.loads(json.dumps({"install": [
        {"metadata": {"name": "Jinja2", "version": "3.1.6"}, "download_info": {"url": "https://x/Jinja2.whl"}},
        {"metadata": {"name": "flash_attn", "version": "2.8.3"}, "download_info": {"url": "https://x/f.tar.gz"}}]}))
    got = gic.installs(report)
    assert sorted(got) == ["flash-attn", "jinja2"] and got["jinja2"]["metadata"]["version"] == "3.1.6"
    output = ("Collecting torch==2.11.0\n  Obtaining dependency information from torch 2.11.0\n"
              "Collecting antlr4-python3-runtime==4.9.3\n  Downloading antlr4-python3-runtime-4.9.3.tar.gz (117 kB)\n"
              "  Installing build dependencies: started\n")
    assert gic.full_downloads(output) == ["antlr4-python3-runtime-4.9.3.tar.gz (117 kB)"]


def test_dist_info_stubs_read_as_installed_distributions(gic, tmp_path):
    requires = ["torch", 'einops; python_version >= "3.9"']
    path = gic.write_dist_info(tmp_path, "flash-attn", "2.8.3", requires, ">=3.9")
    assert path.name == "flash_attn-2.8.3.dist-info"
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert (dist.metadata["Name"], dist.version, dist.requires) == ("flash-attn", "2.8.3", requires)
    assert dist.metadata["Requires-Python"] == ">=3.9"
