"""The layout rules a forker relies on (issues #15, #21, #36): the three scripts at the root, the library in the
deepseek_zero3 package; the package, bench/ and tests/ never import a script (a script is what users run and fork,
not a library); scripts import the package, never each other; the planner is called from one place in setup.

Sizes (lines per module, per function, per line, parameters per function) are guidance in README's "Style" and
`ruff.toml`, not tests: a fork that adds a flag or a metric to train.py must not fail the suite for its length
(issue #61)."""

import ast

import pytest
from conftest import REPO

PACKAGE = REPO / "deepseek_zero3"
SCRIPTS = {"train", "eval", "prepare_data"}
MODULES = sorted(PACKAGE.rglob("*.py"))
SOURCES = sorted(REPO.glob("*.py")) + MODULES + sorted(REPO.glob("bench/*.py")) + sorted(REPO.glob("tests/*.py"))


def imported_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_root_holds_the_scripts_and_the_package():
    assert {p.stem for p in REPO.glob("*.py")} == SCRIPTS
    assert (PACKAGE / "__init__.py").is_file()
    concerns = {p.parent.name for p in MODULES if p.parent != PACKAGE}
    assert all((PACKAGE / c / "__init__.py").is_file() for c in concerns), concerns


def name(path):
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parent.name != "tests"], ids=name)
def test_no_script_imports_a_script(path):
    assert not imported_names(ast.parse(path.read_text())) & SCRIPTS - {path.stem}


@pytest.mark.parametrize("path", MODULES, ids=name)
def test_package_imports_no_script_and_only_absolute(path):
    """A module under the package imports the package by its name, as the scripts, tests and bench do (one way in)."""
    tree = ast.parse(path.read_text())
    assert not imported_names(tree) & SCRIPTS
    relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, f"{path.name}: relative imports at lines {relative}"


def test_setup_calls_the_planner_from_one_place():
    """train.py's setup phases (check, resume, plan, build) visit the planning package once: plan.plan_run."""
    tree = ast.parse((REPO / "train.py").read_text())
    planner = {"plan", "costs", "measure", "model_math"}
    phases = {"setup", "check", "check_resume", "build_model"}
    calls = [
        (fn.name, f"{node.func.value.id}.{node.func.attr}")
        for fn in tree.body
        if isinstance(fn, ast.FunctionDef) and fn.name in phases
        for node in ast.walk(fn)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name) and node.func.value.id in planner
    ]  # fmt: skip
    assert calls == [("setup", "plan.plan_run")]
