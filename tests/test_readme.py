"""Every command in the README's shell blocks names files that exist and flags that the scripts accept."""

import functools
import re
import shlex
import subprocess
import sys

from conftest import ACCELERATE, REPO

SCRIPTS = {"train.py", "eval.py", "prepare_data.py"}


def readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.extend(shlex.split(part) for part in line.split("&&"))
    return commands


@functools.cache
def help_text(*cmd: str) -> str:
    return subprocess.run(list(cmd), cwd=REPO, capture_output=True, text=True, timeout=300).stdout


def flags(tokens):
    return [t.split("=")[0] for t in tokens if t.startswith("--")]


def test_readme_has_the_two_commands():
    commands = readme_commands()
    assert ["make", "quickstart"] in commands and ["make", "test"] in commands
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^quickstart:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_script_config_and_flag_exists():
    checked = 0
    for cmd in readme_commands():
        script_at = next((i for i, t in enumerate(cmd) if t in SCRIPTS), None)
        if script_at is None:
            continue
        script, before, after = cmd[script_at], cmd[:script_at], cmd[script_at + 1:]
        assert (REPO / script).is_file()
        script_help = help_text(sys.executable, script, "--help")
        for flag in flags(after):
            assert flag in script_help, f"{' '.join(cmd)}: {script} has no {flag}"
        if before[:2] == ["accelerate", "launch"]:
            launch_help = help_text(ACCELERATE, "launch", "--help")
            for flag in flags(before):
                assert flag in launch_help, f"accelerate launch has no {flag}"
        for i, t in enumerate(cmd):
            if t in ("--config_file", "--accelerate_config"):
                assert (REPO / cmd[i + 1]).is_file(), cmd[i + 1]
        checked += 1
    assert checked >= 8
