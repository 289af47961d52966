"""A registered model's environment names what its code imports: `served_requirements()` covers
every third-party distribution the served modules import, pinned to what is installed, and never
the project's own distribution (its code travels with the model; no package index has it)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from pipelines.common.serving import SERVED_DISTRIBUTIONS, served_requirements

# Prints the files of the project's modules that serving a model loads, in a fresh interpreter
# (this one has imported far more).
LOADED_BY_SERVING = """
import json, sys
import pipelines.common.serving
print(json.dumps([m.__file__ for n, m in list(sys.modules.items())
                  if n.split(".")[0] in ("sapiens2", "pipelines") and getattr(m, "__file__", None)]))
"""


def _imported_top_level_modules(files: list[str]) -> set[str]:
    """Top-level names of every absolute import in `files`, function-level imports included."""
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(Path(file).read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "sapiens2", "pipelines"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def test_served_requirements_cover_every_distribution_the_served_code_imports() -> None:
    out = subprocess.run([sys.executable, "-c", LOADED_BY_SERVING], capture_output=True, text=True, check=True)
    modules = _imported_top_level_modules(json.loads(out.stdout.strip().splitlines()[-1]))
    assert {"torch", "numpy", "safetensors"} <= modules  # the walk found the model's own imports
    providers = importlib.metadata.packages_distributions()
    declared = {_canonical(name) for name in SERVED_DISTRIBUTIONS}
    # A module several distributions provide (mlflow: mlflow, mlflow-skinny, mlflow-tracing) is
    # covered by any one of them.
    uncovered = {m for m in modules if not declared & {_canonical(d) for d in providers.get(m, [m])}}
    assert not uncovered, f"imported by the served code but in no declared requirement: {sorted(uncovered)}"


def test_served_requirements_are_pinned_installable_releases() -> None:
    pins = dict(requirement.split("==") for requirement in served_requirements())
    assert set(pins) == set(SERVED_DISTRIBUTIONS)
    assert pins["torch"] == importlib.metadata.version("torch").split("+")[0]
    assert all("+" not in version for version in pins.values())
    assert "sapiens2-platform" not in pins
