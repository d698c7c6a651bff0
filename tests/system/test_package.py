"""The package as pip sees it: one version, a license, the typed marker, the torch range,
and extras that match the features that need them (shardwise/extras.py)."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest
import torch

import shardwise
from shardwise.extras import ALSO, EXTRAS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements]


def test_the_version_is_written_once():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shardwise.__version__"}
    try:
        installed = importlib.metadata.version("shardwise")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("shardwise is not installed here (run from the checkout)")
    assert installed == shardwise.__version__


def test_each_extra_installs_what_its_feature_needs():
    extras = PROJECT["optional-dependencies"]
    assert {e: _names(extras[e]) for e in EXTRAS} == {e: [package, *ALSO.get(e, ())]
                                                      for e, (_, package) in EXTRAS.items()}
    assert extras["all"] == [f"shardwise[{','.join(EXTRAS)}]"]
    # the suite builds the digits workload, draws pictures, trains Hugging Face models, reads the loggers back and
    # evaluates with torchmetrics
    assert extras["dev"][0] == "shardwise[demo,plots,hf,tensorboard,mlflow,wandb,eval,config]"
    assert {"pytest", "pytest-timeout"} <= set(_names(extras["dev"]))


def test_torch_is_bounded_and_the_installed_one_is_inside():
    assert "torch>=2.11,<2.14" in PROJECT["dependencies"]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert (2, 11) <= (major, minor) < (2, 14), f"torch {torch.__version__} is outside the tested range"


def test_license_typed_marker_and_changelog():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split("\n")[1].strip() == "Apache License" and "Copyright 2026 the shardwise authors" in text
    assert (ROOT / "shardwise" / "py.typed").exists()
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["shardwise"] == ["py.typed"]
    assert set(PROJECT["urls"]) >= {"Homepage", "Documentation", "Issues"}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and f"## [{shardwise.__version__}]" in changelog
