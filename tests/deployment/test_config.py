"""Configuration: defaults in dask_monarch.yaml, overridden by DASK_MONARCH__... variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

import dask_monarch

DEFAULTS = Path(dask_monarch.__file__).parent / "dask_monarch.yaml"
DOCS = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_environment_variables_override_defaults():
    from dask_monarch import config

    assert config.seconds("flush.idle") == 0.01  # the default, in this process
    code = (
        "import dask_monarch.config as c; "
        "print(c.seconds('flush.idle'), c.seconds('dashboard.interval'))"
    )
    env = {
        **os.environ,
        "DASK_MONARCH__FLUSH__IDLE": "5ms",
        "DASK_MONARCH__DASHBOARD__INTERVAL": "250ms",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.005", "0.25"]


def flatten(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict):
            keys += flatten(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_every_default_is_documented():
    keys = flatten(yaml.safe_load(DEFAULTS.read_text())["dask_monarch"])
    docs = DOCS.read_text()
    missing = [k for k in keys if f"`{k}`" not in docs]
    assert not missing, f"docs/configuration.md does not describe {missing}"
