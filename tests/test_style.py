"""The layout rules a forker relies on (issues #15, #21): scripts import modules, never other scripts; bench/ imports
modules only; no module over 600 lines; no line over 120 characters; no function over 80 lines except train.py's
train(), which holds the loop and the step in one place (120); no function of the three scripts takes more than 6
parameters (what travels together is one object)."""

import ast

import pytest

from conftest import REPO

SCRIPTS = {"train", "eval", "prepare_data"}
SOURCES = sorted(p for p in REPO.glob("*.py")) + sorted(REPO.glob("bench/*.py")) + sorted(REPO.glob("tests/*.py"))


def imported_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parent.name != "tests"], ids=lambda p: p.name)
def test_no_script_imports_a_script(path):
    assert not imported_names(ast.parse(path.read_text())) & SCRIPTS - {path.stem}


FUNCTION_LINES = {("train.py", "train"): 120}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
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


@pytest.mark.parametrize("path", sorted(REPO.glob("*.py")), ids=lambda p: p.name)
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
