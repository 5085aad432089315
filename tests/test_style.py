"""The layout rules a forker relies on (issues #15, #21, #36): the three scripts at the root, the library in the
deepseek_zero3 package; the package, bench/ and tests/ never import a script (a script is what users run and fork,
not a library); scripts import the package, never each other; no module over 600 lines; no line over 120 characters;
no function over 80 lines except train.py's train(), which holds the loop and the step in one place (120); no
function of the three scripts takes more than 6 parameters (what travels together is one object)."""

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


FUNCTION_LINES = {("train.py", "train"): 120}


@pytest.mark.parametrize("path", SOURCES, ids=name)
def test_lines_and_functions_are_short(path):
    text = path.read_text()
    long_lines = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > 120]
    assert not long_lines, f"{path.name}: lines over 120 characters: {long_lines}"
    long_functions = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES.get((path.name, node.name), 80)
    ]
    assert not long_functions, f"{path.name}: functions over their line cap: {long_functions}"


@pytest.mark.parametrize("path", sorted(REPO.glob("*.py")) + MODULES, ids=name)
def test_modules_are_under_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_functions_take_at_most_6_parameters(script):
    tree = ast.parse((REPO / f"{script}.py").read_text())
    wide = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and len(node.args.args) + len(node.args.kwonlyargs) > 6
    ]
    assert not wide, f"{script}.py: functions with more than 6 parameters: {wide}"


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
