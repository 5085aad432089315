"""The layout rules a forker relies on (issue #15): scripts import modules, never other scripts; bench/ imports
modules only; no line over 120 characters; no function over 80 lines."""

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


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_lines_and_functions_are_short(path):
    text = path.read_text()
    long_lines = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > 120]
    assert not long_lines, f"{path.name}: lines over 120 characters: {long_lines}"
    long_functions = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long_functions, f"{path.name}: functions over 80 lines: {long_functions}"
