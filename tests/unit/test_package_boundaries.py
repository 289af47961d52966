"""Import boundaries, read from the source (every import, also those inside functions):
`sapiens2` is a model library that the steps use, never the other way round; its data layer
reads label spaces, not tasks; no two of its modules import each other in a cycle; and a step
(`pipelines/<verb>.py`) uses what the steps share (`pipelines/common/`), never another step.

Not counted as edges: imports under `if TYPE_CHECKING:` (annotations only) and a module's import
of its own parent package (Python runs the parent first anyway).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Orchestration, tracking, storage: the platform's layers above the library.
FORBIDDEN = ("pipelines", "assets", "infra", "mlflow", "dvc", "dagster", "dagster_pipes", "boto3", "botocore")


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """All nodes except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports(package: Path) -> dict[str, set[str]]:
    """module -> every absolute module name it imports at run time (stdlib and third party too)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                # `from pkg import submodule` depends on the submodule; `from pkg import name`, on pkg.
                found |= subs if len(subs) == len(node.names) else {base, *subs}
        graph[name] = {m for m in found if m != name and not name.startswith(m + ".")}
    return graph


def internal_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    internal = {name: deps & graph.keys() for name, deps in graph.items()}
    try:
        tuple(graphlib.TopologicalSorter(internal).static_order())
    except graphlib.CycleError as err:
        return err.args[1]
    return None


@pytest.fixture(scope="module")
def library() -> dict[str, set[str]]:
    return imports(ROOT / "sapiens2")


def test_the_library_imports_no_platform_layer(library) -> None:
    found = {name: sorted(m for m in deps if m.split(".")[0] in FORBIDDEN) for name, deps in library.items()}
    assert {name: deps for name, deps in found.items() if deps} == {}


def test_the_data_layer_reads_label_spaces_not_tasks(library) -> None:
    found = {name: sorted(m for m in deps if m.startswith("sapiens2.tasks"))
             for name, deps in library.items() if name.startswith("sapiens2.data")}
    assert {name: deps for name, deps in found.items() if deps} == {}


def test_no_import_cycle_among_library_modules(library) -> None:
    assert internal_cycle(library) is None


def test_steps_share_pipelines_common_and_never_import_each_other() -> None:
    graph = imports(ROOT / "pipelines")
    steps = {name for name in graph if name.count(".") == 1 and name != "pipelines.cli"}
    assert len(steps) >= 12  # synth, curate, validate, pretrain, finetune, evaluate, register, ...
    crossing = {name: sorted(deps & steps) for name, deps in graph.items() if name != "pipelines.cli"}
    assert {name: deps for name, deps in crossing.items() if deps} == {}
    assert internal_cycle(graph) is None


def test_the_checks_see_a_cycle_and_a_forbidden_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import b  # a parent importing its child\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                                  "def f():\n    import mlflow\n    from .sub.b import g\n")
    (package / "sub" / "b.py").write_text("from ..a import f\nfrom pkg import sub\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = imports(package)
    assert graph["pkg.a"] == {"typing", "mlflow", "pkg.sub.b"}  # TYPE_CHECKING import left out
    assert graph["pkg.sub.b"] == {"pkg.a"}  # its parent packages are not edges
    assert sorted(internal_cycle(graph)[:-1]) == ["pkg.a", "pkg.sub.b"]
    (package / "sub" / "b.py").write_text("g = 1\n")
    assert internal_cycle(imports(package)) is None
