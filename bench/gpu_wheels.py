"""The wheel half of the GPU check (bench/gpu_check.py): what the GPU box lacks, fetched here, installed there.

    prepare   here, where pip reaches PyPI: a Python 3.12 / manylinux x86_64 wheel of each package in CARRIED, in
              one folder with MANIFEST.json (name, version, sha256, size), at most WHEELS_LIMIT_MIB
    verify    there: the folder's files against its manifest
    unmet     there, once installed: what the wheels require that the machine's packages do not give

The box (the device tool's GPU machines) has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, accelerate 1.15,
huggingface_hub 1.33, tokenizers 0.23, pyarrow, numpy, ... but no DeepSpeed, no `datasets`, no lm-eval, no network.
`python bench/gpu_wheels.py` is prepare (what `bash bench/gpu_check.sh prepare` runs): it needs pip and the standard
library only, so any Python with pip makes the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from deepseek_zero3 import cli  # after the path above; it needs the standard library only, as this module

WHEELS = REPO / ".gpu_wheels"
MANIFEST = "MANIFEST.json"
WHEELS_LIMIT_MIB = 60
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
# What the box lacks of what the project needs. None: requirements.txt's pin. DeepSpeed is a source distribution on
# PyPI: its wheel is built here with DS_BUILD_OPS=0, so its ops are JIT-built where they run (ninja and nvcc are
# there). The others are their dependencies the box lacks, at the versions the pinned environment resolved. lm-eval
# goes without its own dependencies: eval.py reads only its WikiText detokenizer, a file it loads by path; its
# --tasks need the harness's dependencies and the tasks' Hub datasets, neither of which the box has.
CARRIED = {
    "deepspeed": None, "hjson": "3.1.0", "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5", "datasets": None, "dill": "0.4.1", "multiprocess": "0.70.19", "lm-eval": None,
}  # fmt: skip
WITHOUT_DEPENDENCIES = {"lm-eval"}
# The packages the carried wheels require that the box has (its image's package list); prepare refuses a wheel that
# requires anything neither carried nor here, so that a new dependency shows here rather than there.
ON_THE_BOX = {"torch", "numpy", "packaging", "psutil", "tqdm", "einops", "msgpack", "ninja", "py-cpuinfo",
              "typing-extensions", "filelock", "pyarrow", "pandas", "xxhash", "fsspec", "huggingface-hub",
              "pyyaml"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# prepare: the wheel folder
# ---------------------------------------------------------------------------------------------------------------------


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_pins() -> dict[str, str]:
    """requirements.txt's `name==version` lines, by canonical name."""
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        named = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s#]+)\s*(#.*)?", line.strip())
        if named:
            pins[canonical(named[1])] = named[2]
    return pins


def wheel_metadata(path: Path) -> dict:
    """Name, version and the Requires-Dist lines of a wheel file, from its METADATA."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = z.read(name).decode("utf-8")
    fields = [line.split(": ", 1) for line in text.split("\n\n", 1)[0].splitlines() if ": " in line]
    return {
        "name": next(v for k, v in fields if k == "Name"),
        "version": next(v for k, v in fields if k == "Version"),
        "requires": [v for k, v in fields if k == "Requires-Dist"],
    }


def needed(requires: list[str]) -> list:
    """The requirements (packaging Requirement) that apply on the box: no extra's, markers evaluated for this
    Python's kind of platform (Linux x86_64, the box's Python version)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a Python with pip alone: pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    env = {"extra": "", "python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip
    reqs = [Requirement(line) for line in requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def pip(*args: str, env: dict | None = None, cwd: Path | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], check=False, capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})})  # fmt: skip
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise cli.UserError(f"pip {args[0]} failed: {lines[-1] if lines else proc.returncode}")


def fetch_wheel(name: str, version: str, into: Path, build: Path) -> None:
    """One wheel for Python 3.12 on manylinux x86_64 into `into`: downloaded, or for DeepSpeed built from its source
    distribution (no ops compiled; the build does not need torch)."""
    if name == "deepspeed":
        pip("download", "--no-deps", "--no-binary=:all:", f"{name}=={version}", "-d", str(build))
        (sdist,) = build.glob("deepspeed-*.tar.gz")
        pip("wheel", "--no-deps", "-w", str(into), str(sdist), env={"DS_BUILD_OPS": "0"})
        return
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *platforms, "-d", str(into), f"{name}=={version}")  # fmt: skip


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_wheels(wheels: list[Path]) -> list[dict]:
    """The manifest rows of a set of wheels; refuses two versions of one package, a wheel that requires what is
    neither carried nor on the box, and a set over WHEELS_LIMIT_MIB."""
    rows = []
    for path in sorted(wheels):
        meta = wheel_metadata(path)
        rows.append({"file": path.name, "name": meta["name"], "version": meta["version"], "sha256": file_sha256(path),
                     "size": path.stat().st_size, "requires": meta["requires"]})  # fmt: skip
    names = [canonical(r["name"]) for r in rows]
    if len(set(names)) != len(names):
        raise cli.UserError(f"two wheels of one package in {', '.join(r['file'] for r in rows)}: keep one")
    for row in rows:
        if canonical(row["name"]) in WITHOUT_DEPENDENCIES:
            continue
        missing = [str(r) for r in needed(row["requires"]) if canonical(r.name) not in {*names, *ON_THE_BOX}]
        if missing:
            raise cli.UserError(
                f"{row['file']} requires {', '.join(missing)}, neither carried nor on the box: add it to CARRIED in "
                "bench/gpu_wheels.py (or to ON_THE_BOX if the box has it)"
            )
    total = sum(r["size"] for r in rows)
    if total > WHEELS_LIMIT_MIB * 2**20:
        raise cli.UserError(
            f"the wheels take {total / 2**20:.1f} MiB, over the {WHEELS_LIMIT_MIB} MiB the check carries"
        )
    return rows


def prepare(folder: Path) -> int:
    """Build the wheel folder; prints the manifest and, on the last line, the folder's path."""
    pins = requirements_pins()
    versions = {name: version or pins[name] for name, version in CARRIED.items()}
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        staged, build = Path(tmp) / "wheels", Path(tmp) / "build"
        staged.mkdir()
        build.mkdir()
        for name, version in versions.items():
            print(f"{name}=={version}", flush=True)
            fetch_wheel(name, version, staged, build)
        rows = check_wheels(list(staged.glob("*.whl")))
        got = {canonical(r["name"]): r["version"] for r in rows}
        if got != versions:
            raise cli.UserError(f"the wheels fetched are {got}, not the {versions} asked for")
        manifest = {"python": PYTHON_VERSION, "platforms": list(PLATFORMS), "total_bytes": sum(r["size"] for r in rows),
                    "wheels": rows}  # fmt: skip
        cli.write_json_atomic(staged / MANIFEST, manifest)
        folder.parent.mkdir(parents=True, exist_ok=True)
        cli.replace_dir(staged, folder)
    for r in rows:
        print(f"  {r['name']:<18} {r['version']:<10} {r['size'] / 2**20:6.2f} MiB  sha256 {r['sha256'][:16]}")
    print(
        f"{len(rows)} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB (limit {WHEELS_LIMIT_MIB}); carry this folder:"
    )
    print(folder)
    return 0


def verify(folder: Path) -> list[dict]:
    """The manifest's rows of a wheel folder, each file checked against its size and sha256 (a copy cut short or
    damaged on its way is refused here, not half-installed)."""
    manifest = folder / MANIFEST
    try:
        rows = json.loads(manifest.read_text())["wheels"]
    except (ValueError, KeyError) as e:
        raise cli.UserError(f"{manifest} is damaged ({e}): copy the folder again, or make it again with prepare") from e
    for w in rows:
        path = folder / w["file"]
        if not path.is_file() or path.stat().st_size != w["size"] or file_sha256(path) != w["sha256"]:
            raise cli.UserError(f"{path} is missing or differs from {manifest}: copy the folder again")
    return rows


# Run by the Python the check's steps run, with their PYTHONPATH (the installed wheels first): argv[1] is a JSON list
# of [wheel, requirement]; prints those the installed distributions do not satisfy.
UNMET = """
import json, sys, importlib.metadata as md
from packaging.requirements import Requirement
out = []
for wheel, line in json.loads(sys.argv[1]):
    r = Requirement(line)
    try:
        found = md.version(r.name)
    except md.PackageNotFoundError:
        found = None
    if found is None or not r.specifier.contains(found, prereleases=True):
        out.append(f"{wheel}: {line} (found {found or 'none'})")
print(json.dumps(out))
"""


def unmet(python: str, env: dict, rows: list[dict]) -> list[str]:
    """What the installed wheels (the manifest's rows, lm-eval's left out) require that `python` with `env` does not
    have, each as 'wheel: requirement (found version)'."""
    reqs = [(w["file"], str(r)) for w in rows if canonical(w["name"]) not in WITHOUT_DEPENDENCIES
            for r in needed(w["requires"])]  # fmt: skip
    proc = subprocess.run([python, "-c", UNMET, json.dumps(reqs)], check=False, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return [f"the check of the requirements failed: {lines[-1] if lines else proc.returncode}"]
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="The GPU check's prepare half (bash bench/gpu_check.sh prepare).").parse_args()
    try:
        sys.exit(prepare(WHEELS))
    except cli.UserError as e:
        cli.print_error(str(e))
        sys.exit(2)
