"""The README's GPU install, proved on a CPU machine with PyPI: all but flash-attn's CUDA build (issue 55, item 0).

The sequence is read from README.md (its Install block's ``# GPU`` line, steps joined by ``&&``), or given with
``--sequence``. In a throw-away venv (``python -m venv``, then ``pip install -U pip``) whose pip sees PyPI only
(no pip config file), the script checks:

(a) step 1 resolves: ``pip install --dry-run --ignore-installed --report`` of its packages;
(b) step 2 is flash-attn's documented form: its sdist (downloaded from PyPI, never built) has no pyproject.toml
    and a setup.py that imports torch at module level, so pip's isolated build (setuptools only) cannot run it;
    its README installs with ``pip install flash-attn --no-build-isolation``; every package its build imports
    (setup.py's imports, plus the README's required ``ninja``) is in step 1, and setup.py's imports other than
    torch run in the venv with step 1's versions of those packages; torch's CUDA matches verl's extra name;
(c) step 3 resolves without building flash-attn once steps 1-2 are done: step 1's packages and flash-attn 2.8.3
    are written into the venv as ``.dist-info`` metadata (their real Requires-Dist), then
    ``pip install --dry-run --report -e <a copy of this checkout>[gpu]`` must keep torch and flash-attn and
    resolve verl 0.9.1 and vllm 0.24.0; and the contrast, without the flash-attn metadata: pip builds the sdist's
    metadata in isolation and fails on ``import torch``.

Dry runs read metadata only: PEP 658 files where the index serves them, else HTTP range requests
(``--use-feature=fast-deps``); the script counts what pip downloads whole (sdists). A few minutes, a few MB.

    python benchmarks/gpu_install_check.py [--python python3.12] [--sequence "pip install ... && ..."] [--record]

Exit status 1 when a check fails. Not part of the test suite (it needs PyPI); tests/test_gpu_install_check.py
tests its helpers offline.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLASH_ATTN, VERL, VLLM = ("flash-attn", "2.8.3"), ("verl", "0.9.1"), ("vllm", "0.24.0")
KEEP_PIP_ENV = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL", "PIP_PROXY",
                "PIP_TRUSTED_HOST", "PIP_DISABLE_PIP_VERSION_CHECK"}


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "amir_verl" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- pure helpers (tests/test_gpu_install_check.py) ----

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def readme_sequence(readme: str) -> list[list[str]]:
    """The GPU install line of README.md's Install block (``... && ... && ...   # GPU``), as argv lists."""
    for line in readme.splitlines():
        code, _, comment = line.partition("#")
        if comment.strip() == "GPU" and code.strip().startswith("pip install"):
            return split_sequence(code)
    raise ValueError("README.md has no '... # GPU' install line")


def split_sequence(text: str) -> list[list[str]]:
    return [shlex.split(part) for part in text.split("&&")]


def requirements_of(argv: list[str]) -> list[str]:
    """The requirement arguments of a ``pip install`` argv (options and their values dropped)."""
    assert argv[:2] == ["pip", "install"], argv
    out, skip = [], False
    for arg in argv[2:]:
        if skip:
            skip = False
        elif arg in ("-e", "--editable"):
            out.append("-e")  # its value, the project, follows
        elif arg.startswith("-"):
            skip = arg in ("-c", "-r", "-i", "--index-url", "--extra-index-url")
        else:
            out.append(arg)
    return out


def imported_modules(source: str, top_level_only: bool = False) -> set[str]:
    """Top-level names of the modules a Python source imports (anywhere, or at module level only), minus stdlib."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names)


def readme_python_packages(readme: str) -> set[str]:
    """flash-attn's README requirements of the form ``- `ninja` Python package``."""
    return set(re.findall(r"^- `([\w-]+)` Python package", readme, flags=re.M))


def documented_commands(readme: str) -> list[list[str]]:
    """The ``pip install ...`` lines of a README, as argv lists (leading VAR=value assignments dropped)."""
    out = []
    for line in readme.splitlines():
        try:
            words = shlex.split(line, comments=True) if "pip install" in line else []
        except ValueError:  # prose with an apostrophe
            continue
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            words = words[1:]
        if words[:2] == ["pip", "install"] and words not in out:
            out.append(words)
    return out


def unpinned(argv: list[str]) -> list[str]:
    return [re.sub(r"^([\w.-]+)==\S+$", r"\1", arg) for arg in argv]


def installs(report: dict) -> dict[str, dict]:
    """``pip install --report``'s install list: canonical name -> that item (its metadata, download_info)."""
    return {canonical(item["metadata"]["name"]): item for item in report["install"]}


def write_dist_info(site: Path, name: str, version: str, requires: list[str] = (),
                    requires_python: str | None = None) -> Path:
    """Minimal ``<name>-<version>.dist-info`` that pip takes as an installed distribution."""
    path = Path(site) / f"{re.sub(r'[-.]+', '_', name)}-{version}.dist-info"
    path.mkdir(parents=True, exist_ok=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Python: {requires_python}"] if requires_python else []
    lines += [f"Requires-Dist: {r}" for r in requires]
    (path / "METADATA").write_text("\n".join(lines) + "\n")
    (path / "INSTALLER").write_text("gpu_install_check\n")
    (path / "RECORD").write_text("")
    return path


def full_downloads(pip_output: str) -> list[str]:
    """What pip downloaded whole (``Downloading <file> (<size>)``), metadata reads excluded."""
    return [m.group(1) for m in re.finditer(r"^\s*Downloading (\S+(?: \([^)]*\))?)", pip_output, flags=re.M)]


def cuda_of_torch(requires_dist: list[str]) -> str | None:
    """``13.0`` from a PyPI torch's ``cuda-toolkit[...]==13.0.2`` requirement (older wheels: ``nvidia-*-cu12``)."""
    for req in requires_dist:
        m = re.match(r"cuda-toolkit\[[^]]*\]\s*==\s*(\d+)\.(\d+)", req)
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    return None


def flash_attn_wheel_guess(fa_version: str, torch_version: str, cuda: str, python_tag: str) -> str:
    """The GitHub release wheel flash-attn's setup.py (CachedWheelsCommand) tries first: every CUDA >= 12 is 'cu12'."""
    major, minor = torch_version.split(".")[:2]
    cu = "11" if cuda.startswith("11.") else "12"
    return f"flash_attn-{fa_version}+cu{cu}torch{major}.{minor}cxx11abiTRUE-{python_tag}-{python_tag}-linux_x86_64.whl"


# ---- the check ----

PROBE = """
import importlib, json, setuptools.build_meta  # as pip's build runs setup.py: the backend first
failed, modules = [], {}
for statement in %r:
    try:
        exec(statement)
    except Exception as error:
        failed.append(f"{statement}: {error!r}")
for name in %r:
    try:
        module = importlib.import_module(name)
    except ImportError:
        modules[name] = "MISSING"
    else:
        modules[name] = "(setuptools' vendored copy)" if "/setuptools/_vendor/" in module.__file__ else "installed"
print(json.dumps({"failed": failed, "modules": modules}))
"""

class Venv:
    def __init__(self, path: Path, python: str):
        self.path, self.env = path, {k: v for k, v in os.environ.items()
                                     if (not k.startswith("PIP_") or k in KEEP_PIP_ENV) and k != "PYTHONPATH"}
        self.env["PIP_CONFIG_FILE"] = os.devnull  # no find-links, local indexes or constraints: PyPI only
        subprocess.run([python, "-m", "venv", str(path)], check=True, env=self.env)
        self.python = str(path / "bin" / "python")
        self.pip("install", "-q", "--no-cache-dir", "-U", "pip", check=True)
        self.site = Path(self.run_py("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())

    def pip(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        done = subprocess.run([self.python, "-m", "pip", *args], env=self.env, capture_output=True, text=True)
        if check and done.returncode:
            raise RuntimeError(f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def dry_run(self, *args: str, report: Path, ignore_installed: bool = False) -> tuple[int, dict | None, str]:
        done = self.pip("install", "--dry-run", "--no-cache-dir", "--use-feature=fast-deps", "--report", str(report),
                        *(["--ignore-installed"] if ignore_installed else []), *args)
        output = done.stdout + done.stderr
        return done.returncode, (json.loads(report.read_text()) if not done.returncode else None), output

    def run_py(self, code: str) -> str:
        return subprocess.run([self.python, "-c", code], env=self.env, capture_output=True, text=True,
                              check=True).stdout


def fetch_sdist(name: str, version: str, into: Path, env: dict) -> Path:
    """The sdist from the index's JSON (PEP 691) page, its sha256 checked."""
    index = env.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    context = ssl.create_default_context(cafile=env.get("PIP_CERT"))
    request = urllib.request.Request(f"{index}/{canonical(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(request, context=context, timeout=120))["files"]
    wanted = f"{name.replace('-', '_')}-{version}.tar.gz"
    entry = next(f for f in files if f["filename"] == wanted)
    data = urllib.request.urlopen(entry["url"], context=context, timeout=300).read()
    assert hashlib.sha256(data).hexdigest() == entry["hashes"]["sha256"], wanted
    path = into / wanted
    path.write_bytes(data)
    return path


def sdist_files(path: Path, *names: str) -> dict[str, str | None]:
    with tarfile.open(path) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        return {n: (tar.extractfile(members[n]).read().decode() if n in members else None) for n in names}


def project_copy(into: Path) -> Path:
    """setup.py, README.md and the package: what pip needs for the editable install's metadata."""
    dest = into / "amir-verl"
    shutil.copytree(ROOT / "amir_verl", dest / "amir_verl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


def check(args) -> int:
    start = time.perf_counter()
    sequence = split_sequence(args.sequence) if args.sequence else readme_sequence((ROOT / "README.md").read_text())
    rows: list[tuple[str, bool, str]] = []

    def row(step: str, ok: bool, detail: str):
        rows.append((step, bool(ok), detail))
        print(f"[{'ok' if ok else 'FAIL'}] {step}: {detail}", flush=True)

    print("sequence:\n" + "\n".join(f"  {i}. {shlex.join(argv)}" for i, argv in enumerate(sequence, 1)))
    if len(sequence) != 3 or any(argv[:2] != ["pip", "install"] for argv in sequence):
        row("sequence", False, "expected three `pip install` steps")
        return summary(rows, start)
    step1, step2, step3 = (requirements_of(argv) for argv in sequence)

    with tempfile.TemporaryDirectory(prefix="gpu_install_check-") as tmp:
        tmp = Path(tmp)
        venv = Venv(tmp / "venv", args.python)
        pyver = venv.run_py("import sys, pip; print(sys.version.split()[0], pip.__version__)").split()
        print(f"throw-away venv: Python {pyver[0]}, pip {pyver[1]}; pip config: none (PyPI only)")

        # (a) step 1 resolves
        rc, rep1, out = venv.dry_run(*step1, report=tmp / "step1.json", ignore_installed=True)
        got1 = installs(rep1) if rep1 else {}
        row("(a) step 1 resolves", rc == 0 and canonical(step1[0].split("==")[0]) in got1,
            f"{len(got1)} packages, torch {got1.get('torch', {}).get('metadata', {}).get('version')}; "
            f"downloaded whole: {full_downloads(out) or 'nothing'}" if rc == 0 else out.strip().splitlines()[-1])
        if rc:
            return summary(rows, start)

        # (b) step 2: flash-attn's documented form, and its build's needs
        sdist = fetch_sdist(*FLASH_ATTN, tmp, venv.env)
        files = sdist_files(sdist, "setup.py", "README.md", "pyproject.toml", "PKG-INFO")
        setup_py, fa_readme = files["setup.py"], files["README.md"]
        documented = documented_commands(fa_readme)
        row("(b) step 2 is flash-attn's documented command",
            unpinned(sequence[1]) in documented and step2 == ["==".join(FLASH_ATTN)],
            "sdist README: " + " | ".join(shlex.join(c) for c in documented if FLASH_ATTN[0] in c))
        at_import = imported_modules(setup_py, top_level_only=True)
        row("(b) isolated build cannot work", files["pyproject.toml"] is None and "torch" in at_import,
            f"no pyproject.toml (pip's isolated build env: setuptools only); setup.py imports at module level: "
            f"{', '.join(sorted(at_import))}")
        needs = imported_modules(setup_py) | readme_python_packages(fa_readme)
        missing = sorted(n for n in needs if canonical(n) not in got1)
        row("(b) the build's imports are in step 1", not missing,
            f"needs {', '.join(sorted(needs))}" + (f"; MISSING from step 1: {', '.join(missing)}" if missing else ""))
        # the build's Python side as pip runs it (setuptools' backend imported first), with step 1's versions of
        # the packages it needs; torch left out (its CUDA wheels are GBs; that it imports is the CUDA build's part)
        build_set = [f"{got1[canonical(n)]['metadata']['name']}=={got1[canonical(n)]['metadata']['version']}"
                     for n in sorted(needs) if canonical(n) in got1 and canonical(n) != "torch"]
        venv.pip("install", "-q", "--no-cache-dir", "--no-deps", *build_set, check=True)
        statements = [ast.unparse(n) for n in ast.parse(setup_py).body if isinstance(n, (ast.Import, ast.ImportFrom))
                      and "torch" not in imported_modules(ast.unparse(n))]
        probe = json.loads(venv.run_py(PROBE % (statements, sorted(needs - {"torch"}))))
        row("(b) setup.py's imports but torch run", not probe["failed"],
            f"with {', '.join(build_set) or 'nothing'} installed: "
            + ", ".join(f"{n} {where}" for n, where in probe["modules"].items())
            + (f"; failed: {'; '.join(probe['failed'])}" if probe["failed"] else ""))
        torch_meta = got1["torch"]["metadata"]
        cuda = cuda_of_torch(torch_meta.get("requires_dist", []))
        py_tag = "cp" + pyver[0].split(".")[0] + pyver[0].split(".")[1]
        guess = flash_attn_wheel_guess(FLASH_ATTN[1], torch_meta["version"], cuda or "12", py_tag)
        print(f"     torch {torch_meta['version']} from PyPI is a CUDA {cuda} build. flash-attn's bdist_wheel first "
              f"downloads {guess} from its GitHub release (a CUDA 12 name; the release predates torch 2.11) and "
              f"compiles when that fails: nvcc {cuda} needed, psutil unless MAX_JOBS is set, ninja for speed")

        # (c) step 3 with steps 1-2 done: their metadata in site-packages
        installed = {canonical(line.split("==")[0]) for line in venv.pip("freeze", "--all").stdout.split()}
        for name, item in got1.items():
            if name not in installed:
                meta = item["metadata"]
                write_dist_info(venv.site, meta["name"], meta["version"], meta.get("requires_dist", []),
                                meta.get("requires_python"))
        fa_requires = re.findall(r"^Requires-Dist: (.+)$", files["PKG-INFO"], flags=re.M)
        fa_python = re.search(r"^Requires-Python: (.+)$", files["PKG-INFO"], flags=re.M)
        stub = write_dist_info(venv.site, *FLASH_ATTN, fa_requires, fa_python and fa_python.group(1))
        project = project_copy(tmp)
        editable = ["-e", f"{project}{step3[1].removeprefix('.')}"] if step3[:1] == ["-e"] else step3
        rc, rep3, out = venv.dry_run(*editable, report=tmp / "step3.json")
        got3 = installs(rep3) if rep3 else {}

        def version(name):
            return got3.get(name, {}).get("metadata", {}).get("version")
        sdists = sorted(n for n, item in got3.items() if not item["download_info"]["url"].endswith(".whl")
                        and n != "amir-verl")
        changed = sorted(f"{n} {got1[n]['metadata']['version']} -> {version(n)}" for n in got3 if n in got1)
        ok = (rc == 0 and "flash-attn" not in got3 and "torch" not in got3
              and version("verl") == VERL[1] and version("vllm") == VLLM[1])
        row("(c) step 3 resolves, flash-attn and torch kept", ok,
            (f"{len(got3)} packages to install, verl {version('verl')}, vllm {version('vllm')}, flash-attn and "
             f"torch already satisfied; step 1's packages it changes: {', '.join(changed) or 'none'}; sdists to "
             f"build there: {', '.join(sdists) or 'none'}; downloaded whole: "
             f"{full_downloads(out) or 'nothing'}") if rc == 0 else out.strip().splitlines()[-1])
        verl_extras = got3.get("verl", {}).get("metadata", {}).get("provides_extra", [])
        extra = f"flash-attn-cu{(cuda or '').replace('.', '')}torch{''.join(torch_meta['version'].split('.')[:2])}"
        row("(c) torch's CUDA is verl's flash-attn extra's", extra in verl_extras,
            f"verl's extra {extra!r} " + ("exists" if extra in verl_extras else f"not in {verl_extras}"))

        # the contrast: without flash-attn's metadata, pip builds its sdist in isolation
        shutil.rmtree(stub)
        rc, _, out = venv.dry_run(*editable, report=tmp / "contrast.json")
        error = next((line.strip() for line in out.splitlines() if "ModuleNotFoundError" in line), "")
        row("(c) contrast: step 3 without step 2", rc != 0 and "No module named 'torch'" in error,
            f"pip exits {rc}: {error or out.strip().splitlines()[-1]}")
    return summary(rows, start)


def summary(rows, start) -> int:
    width = max(len(step) for step, _, _ in rows)
    print("\n| step | result |\n|---|---|")
    for step, ok, _ in rows:
        print(f"| {step:<{width}} | {'ok' if ok else 'FAIL'} |")
    print(f"\n{sum(ok for _, ok, _ in rows)}/{len(rows)} checks passed in {time.perf_counter() - start:.0f} s")
    return 0 if all(ok for _, ok, _ in rows) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter the throw-away venv is made from")
    parser.add_argument("--sequence", help="the three steps joined by '&&' (default: README.md's GPU line)")
    parser.add_argument("--record", action="store_true", help="also write docs/results/gpu_install_check.md")
    args = parser.parse_args(argv)
    if not args.record:
        return check(args)
    page = _results_page()
    with page.printed() as out:
        status = check(args)
    command = page.script_command(None if argv is None else [__file__, *argv])
    print(f"wrote {page.write_results('gpu_install_check', command, page.text_block(out.getvalue()))}")
    return status


if __name__ == "__main__":
    sys.exit(main())
