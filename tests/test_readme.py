"""Every command in the shell blocks of README.md and docs/*.md names files that exist and flags that the scripts
accept; every link between them resolves; README stays a front door."""

import re
import shlex
from pathlib import Path

from conftest import REPO

SCRIPTS = {"train.py", "eval.py", "prepare_data.py"}


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands() -> list[list[str]]:
    text = "\n".join(doc.read_text() for doc in DOCS)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.extend(shlex.split(part) for part in line.split("&&"))
    return commands


def script_config(script: str):
    import eval as ev
    import prepare_data
    import train

    return {"train.py": train.Config, "eval.py": ev.Config, "prepare_data.py": prepare_data.Config}[script]


def test_every_script_config_and_flag_exists():
    """Each README command's arguments go through the real parsers (the script's HfArgumentParser, accelerate
    launch's): an unknown flag, a missing value or a bad type fails, not only a flag name that vanished."""
    from accelerate.commands.launch import launch_command_parser
    from transformers import HfArgumentParser

    checked = 0
    for cmd in readme_commands():
        script_at = next((i for i, t in enumerate(cmd) if t in SCRIPTS), None)
        if script_at is None:
            continue
        script, before, after = cmd[script_at], cmd[:script_at], cmd[script_at + 1 :]
        assert (REPO / script).is_file()
        try:
            HfArgumentParser(script_config(script), allow_abbrev=False).parse_args_into_dataclasses(after)
            if before[:2] == ["accelerate", "launch"]:
                launch_command_parser().parse_args(before[2:] + [script])
        except (SystemExit, ValueError):  # argparse exits on a bad value; HfArgumentParser raises on unknown flags
            raise AssertionError(f"README command does not parse: {' '.join(cmd)}") from None
        for i, t in enumerate(cmd):
            if t in ("--config_file", "--accelerate_config"):
                assert (REPO / cmd[i + 1]).is_file(), cmd[i + 1]
        checked += 1
    assert checked >= 8


def test_the_parser_check_fails_on_a_wrong_flag():
    from transformers import HfArgumentParser

    HfArgumentParser(script_config("train.py")).parse_args_into_dataclasses(["--lr_decay_steps", "5"])
    for bad in (["--decay_steps", "5"], ["--lr"], ["--max_steps", "many"]):
        try:
            HfArgumentParser(script_config("train.py")).parse_args_into_dataclasses(bad)
        except (SystemExit, ValueError):
            continue
        raise AssertionError(f"{bad} parsed")


def test_every_gpu_training_command_fits_its_gpus(capsys):
    """Each `accelerate launch ... train.py` of the README on a GPU config, planned as a user would before launching
    it (`train.py --plan` with the same config and flags; train.main in this process, which is what `python train.py`
    runs): the memory it needs per GPU fits the GPU. Two of them lacked the micro-batch and checkpointing flags that
    make 1.3B fit (43 of 24 GiB: issue #35)."""
    import train

    planned = 0
    for cmd in readme_commands():
        if cmd[:2] != ["accelerate", "launch"] or "train.py" not in cmd:
            continue
        at = cmd.index("train.py")
        config = cmd[cmd.index("--config_file") + 1]
        if "cpu" in Path(config).name:  # CPU runs: small presets, and their plan times the model on this machine
            continue
        assert train.main(["--plan", "--accelerate_config", config, *cmd[at + 1 :]]) == 0, " ".join(cmd)
        stdout = capsys.readouterr().out
        need = re.search(r"needs ([\d.]+) GiB of ([\d.]+) GiB per GPU", stdout)
        assert need and float(need[1]) <= float(need[2]), (" ".join(cmd), stdout[-2000:])
        planned += 1
    assert planned >= 4


def test_links_between_the_docs_resolve():
    """A relative link in README.md or docs/*.md names a file of the checkout (and, with #anchor, a heading there)."""
    import re

    def anchors(path: Path) -> set[str]:
        heads = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
        return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in heads}

    checked = 0
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            assert path.exists(), f"{doc.name}: link to {target}: no such file"
            if anchor:
                assert anchor in anchors(path), f"{doc.name}: link to {target}: no such heading"
            checked += 1
    assert checked >= 10


def test_readme_is_a_front_door():
    """README.md is read in five minutes (issue #61): at most ~250 lines, the rest by topic under docs/, each linked."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for doc in DOCS[1:]:
        assert f"docs/{doc.name}" in text, f"README.md does not link docs/{doc.name}"
