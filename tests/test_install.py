"""The README's install steps hold: extras that exist, torch kept, a wheel for other machines.

pip runs here without an index (``--no-index``): what it resolves is what
this environment has, so nothing is downloaded and the answers are the
ones a user with the same torch installed gets.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STDLIB = sys.stdlib_module_names
IMPORT_NAMES = {"pyyaml": "yaml"}  # distribution -> module, where they differ

pytestmark = pytest.mark.timeout(300)


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def requirements(text: str) -> list[str]:
    """Distribution names of a setup.cfg requirement list (comments and versions dropped)."""
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def extras() -> dict[str, list[str]]:
    cfg = setup_cfg()
    return {k: requirements(v) for k, v in cfg["options.extras_require"].items()}


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_every_extra_the_docs_name_exists():
    named = set()
    for path in DOCS:
        named |= set(re.findall(r"pip install -e \"?\.\[([\w,-]+)\]", path.read_text()))
    named = {e for group in named for e in group.split(",")}
    assert {"test", "notebooks"} <= named, named
    assert named <= set(extras()), f"extras named but not in setup.cfg: {named - set(extras())}"


def test_the_notebooks_extra_gives_what_the_notebooks_import():
    cfg = setup_cfg()
    have = set(requirements(cfg["options"]["install_requires"])) | set(extras()["notebooks"])
    have = {IMPORT_NAMES.get(name, name).replace("-", "_") for name in have} | {"dask_monarch"}
    assert "jupyterlab" in have and "ipykernel" in have  # something to open them in
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            for module in re.findall(r"^\s*(?:import|from)\s+(\w+)", source, flags=re.M):
                assert module in STDLIB or module in have, f"{path.name} imports {module}"


def test_the_readme_says_where_a_cpu_torch_comes_from_and_what_the_index_gives():
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    assert "CUDA build" in README and "not published on PyPI" in README
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first.count("pip install torch==2.13.0 && pip install -e ") == 2  # what .ci/run runs
    assert "is a CPU build" not in README  # only this project's machines have that wheel


def test_installing_the_package_keeps_the_installed_torch():
    """``pip install -e ".[test]"`` with torch installed: only the package is (re)installed."""
    done = pip("install", "--dry-run", "--no-index", "--no-build-isolation", "-e", ".[test]")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("Would install")]
    assert "torch" not in line.lower(), line


def test_a_wheel_for_the_other_machines_of_a_cluster(tmp_path):
    """The README's ``pip wheel --no-deps -w dist .``: the wheel carries the settings, the
    dashboard page and the commands."""
    done = pip("wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(tmp_path), ".")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip wheel --no-deps -w dist ." in README
    (wheel,) = tmp_path.glob("dask_monarch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("dask_monarch/dask_monarch.yaml", "dask_monarch/observability/dashboard.html"):
        assert needed in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dask-monarch" in zipfile.ZipFile(wheel).read(entry_points).decode()
