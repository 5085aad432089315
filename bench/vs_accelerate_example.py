"""train.py against Accelerate's own DeepSpeed example, the peer a user would start from instead.

    git clone https://github.com/huggingface/accelerate && git -C accelerate checkout v1.15.0
    python bench/vs_accelerate_example.py --accelerate_repo accelerate [--steps 150] [--rounds 2]

The peer is examples/by_feature/deepspeed_with_config_support.py of the checkout (the version of the installed
accelerate), launched exactly as train.py is: `accelerate launch --config_file accelerate_configs/zero3_cpu.yaml
--num_processes 3`, fp32, the `mini` preset, 8 sequences x 128 tokens per process and step, --steps optimizer steps,
alternated for --rounds rounds (example, train.py, example, train.py). Steady state: the steps after the first third
(from the first log step of train.py at or past it), per second of wall time.

Both read the same data: python-docs prepared by prepare_data.py (BPE 8192). The example reads text, so its
--train_file / --validation_file are the prepared documents decoded with the prepared tokenizer, EOS included; the
bench checks that the tokenizer encodes them back to exactly the prepared ids, and that both runs count the same
number of 128-token training windows. Its --config_name is the config train.py builds for `mini` on this data
(vocabulary padded to 64), its --tokenizer_name the prepared tokenizer; it runs offline (HF_HUB_OFFLINE,
HF_DATASETS_OFFLINE). train.py runs on its defaults (step-0 validation on, log every 10 steps) with only
--eval_every 0 --save_every 0, so that no validation or checkpoint lands inside the timed steps (both still run at
the end, as the example's evaluation and save_state do, after its timed steps).

The example is copied to a temporary directory and changed there by exact string replacement, the PATCHES below and
nothing else; a replacement that does not match stops the bench (the checkout is another version of the example).
The row names the file by its git blob: c7dcbf1a at v1.14.0 and on main at 1.15.0.dev0 alike.

What still differs, by design (each is what the example or train.py does when a user runs it): the example's
DataLoader (shuffled Arrow rows, default_data_collator, an all-ones attention_mask, labels for the model's own loss)
against train.py's windows from a memmap; its linear LR schedule (5e-5, weight decay 0) against train.py's warmup
and cosine (1e-3, 0.1); train.py's step-0 validation, its one small all-reduce per step (loss and stop flag) and a
log line every 10 steps, whose own time train.py leaves out of its tokens/s. Both clip gradients at 1.0 (DeepSpeed's
gradient_clipping: Accelerate fills "auto" with 1.0, train.py sets it), both use torch AdamW and sdpa attention.
"""

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import accelerate
import numpy as np
from common import REPO, free_port, machine, prepare_docs, record

from deepseek_zero3.model import models
from deepseek_zero3.training_data import token_data

EXAMPLE = Path("examples") / "by_feature" / "deepspeed_with_config_support.py"
MODEL, SEQ_LEN, MICRO_BATCH, PROCESSES = "mini", 128, 8, 3
LAUNCH = [
    "accelerate",
    "launch",
    "--config_file",
    "accelerate_configs/zero3_cpu.yaml",
    "--num_processes",
    str(PROCESSES),
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# (why, text in the example, its replacement): each must match exactly once.
PATCHES = [
    (
        (
            "CPU processes: name gloo, as train.py does; without it Accelerate runs each of the 3 processes as a "
            "world of 1 and DeepSpeed stops on the batch size (8 != 8 * 1 * 3)"
        ),
        "from accelerate.utils import DummyOptim, DummyScheduler, set_seed\n",
        "from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs, set_seed\n",
    ),
    (
        "the same, in the Accelerator the example builds without --with_tracking",
        "else Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)\n",
        (
            "else Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, "
            'kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])\n'
        ),
    ),
    (
        (
            "a Llama model: its norms join the no-decay group, which holds no parameter of a model without biases "
            "or LayerNorm; DeepSpeed drops an empty group and the LR scheduler then stops at its first step "
            "(zip() argument 2 is longer than argument 1)"
        ),
        '    no_decay = ["bias", "LayerNorm.weight"]\n',
        '    no_decay = ["bias", "LayerNorm.weight", "norm.weight"]\n',
    ),
    ("per-step timing: the clock", "import random\n", "import random\nimport time\n"),
    (
        "per-step timing: one line on the main process after each optimizer step, with the number of processes",
        "                    completed_steps += 1\n",
        (
            "                    completed_steps += 1\n"
            '                    accelerator.print(f"bench: step {completed_steps} of {accelerator.num_processes} '
            'processes at {time.perf_counter():.6f} s")\n'
        ),
    ),
]


def refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def patched_example(source: str) -> str:
    for why, old, new in PATCHES:
        if source.count(old) != 1:
            refuse(
                f"the patch '{why}' expects {old.strip()!r} once in {EXAMPLE}, found it {source.count(old)} times: "
                f"this checkout holds another version of the example; check out v1.15.0"
            )
        source = source.replace(old, new)
    return source


def git_blob_sha1(data: bytes) -> str:
    """What `git hash-object` prints for a file: names the example's exact text, with or without a git checkout."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def checkout_version(repo: Path) -> str:
    setup = (repo / "setup.py").read_text() if (repo / "setup.py").is_file() else ""
    version = re.search(r'version="([^"]+)"', setup)
    commit = subprocess.run(
        ["git", "-C", str(repo), "describe", "--tags", "--always"], check=False, capture_output=True, text=True
    )
    return f"{version.group(1) if version else 'unknown version'} ({commit.stdout.strip() or 'not a git checkout'})"


def write_text_splits(data: Path, out: Path) -> None:
    """The prepared splits as JSON lines of {"text": document} for the example, each document's ids (through its EOS)
    decoded with the prepared tokenizer; stops unless the tokenizer encodes the text back to the same ids."""
    from transformers import AutoTokenizer

    meta = token_data.read_meta(data)
    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    out.mkdir(parents=True)
    for split in ("train", "validation"):
        ids = np.asarray(token_data.load_split(data, split, meta))
        docs = [d for d in np.split(ids, np.flatnonzero(ids == meta["eos_id"]) + 1) if len(d)]
        texts = [tok.decode(d.tolist()) for d in docs]
        again = [i for e in tok(texts)["input_ids"] for i in e]
        if again != ids.tolist():
            raise SystemExit(f"the prepared {split} split does not survive decode and encode; the data would differ")
        (out / f"{split}.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)


def failed(cmd: list[str], proc: subprocess.CompletedProcess) -> None:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def train_py_round(data: Path, out: Path, steps: int) -> dict:
    """train.py's per-log-interval training seconds (validation and checkpoint pauses excluded by train.py) and its
    count of training windows; stops unless its batch plan says 3 processes under DeepSpeed."""
    cmd = LAUNCH + ["--main_process_port", str(free_port()), "train.py", "--data_dir", str(data), "--output_dir"]
    cmd += [str(out), "--model_config", MODEL, "--seq_len", str(SEQ_LEN), "--micro_batch_size", str(MICRO_BATCH)]
    cmd += ["--max_steps", str(steps), "--eval_every", "0", "--save_every", "0"]
    cmd += ["--optimizer", "adamw"]  # the example's
    proc = run(cmd, OFFLINE)
    if proc.returncode != 0:
        failed(cmd, proc)
    plan = re.search(
        r"batch plan: .* x (\d+) processes = .* = ([\d,]+) tokens per step; .* epochs of ([\d,]+) "
        r"windows\); (\w+), (\w+)",
        proc.stdout,
    )
    if not plan or (int(plan.group(1)), plan.group(4), plan.group(5)) != (PROCESSES, "DEEPSPEED", "fp32"):
        raise SystemExit(
            f"train.py was to train on {PROCESSES} DeepSpeed processes in fp32; its batch plan says: "
            f"{plan.group(0) if plan else 'nothing'}"
        )
    tokens_per_step = int(plan.group(2).replace(",", ""))
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    intervals, last = {}, 0
    for r in records:
        intervals[(last, r["step"])] = (r["step"] - last) * tokens_per_step / r["tokens_per_s"]
        last = r["step"]
    return {"intervals_s": intervals, "windows": int(plan.group(3).replace(",", ""))}


def example_round(script: Path, text: Path, config: Path, data: Path, out: Path, steps: int) -> dict:
    """The patched example's clock after each step, its count of training windows and whether it ended in the gloo
    teardown abort (see cli.exit_process): a process killed by SIGABRT, the others stopped by the launcher's SIGTERM,
    after the example wrote its closing all_results.json. Any other failure stops the bench."""
    cmd = LAUNCH + ["--main_process_port", str(free_port()), str(script), "--train_file", str(text / "train.json")]
    cmd += ["--validation_file", str(text / "validation.json"), "--config_name", str(config), "--tokenizer_name"]
    cmd += [str(data / "tokenizer"), "--block_size", str(SEQ_LEN), "--per_device_train_batch_size", str(MICRO_BATCH)]
    cmd += ["--max_train_steps", str(steps), "--output_dir", str(out)]
    proc = run(cmd, {**OFFLINE, "HF_DATASETS_CACHE": str(out.parent / f"{out.name}_datasets_cache")})
    exit_codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)}
    teardown_abort = (
        proc.returncode != 0 and exit_codes <= {-6, -15} and -6 in exit_codes and (out / "all_results.json").is_file()
    )
    if proc.returncode != 0 and not teardown_abort:
        failed(cmd, proc)
    clock = {
        int(s): (int(n), float(t))
        for s, n, t in re.findall(r"bench: step (\d+) of (\d+) processes at ([\d.]+) s", proc.stdout)
    }
    if sorted(clock) != list(range(1, steps + 1)) or {n for n, _ in clock.values()} != {PROCESSES}:
        raise SystemExit(
            f"the example was to run {steps} steps on {PROCESSES} processes; it printed "
            f"{len(clock)} step lines with processes {sorted({n for n, _ in clock.values()})}"
        )
    epochs = re.search(r"Num Epochs = (\d+)", proc.stderr)
    windows = re.search(r"Num examples = (\d+)", proc.stderr)
    if not epochs or int(epochs.group(1)) != 1:
        raise SystemExit(
            f"the example planned {epochs.group(1) if epochs else '?'} epochs: its end-of-epoch "
            f"evaluation and checkpoint would fall inside the timed steps; lower --steps"
        )
    return {
        "clock": {s: t for s, (_, t) in clock.items()},
        "windows": int(windows.group(1)),
        "teardown_abort": teardown_abort,
    }


def steady_window(intervals_s: dict, steps: int) -> tuple[int, float]:
    """(first step, train.py seconds) of the steady state: train.py's log intervals that start at or after a third of
    the steps."""
    kept = {k: v for k, v in intervals_s.items() if k[0] >= steps // 3}
    if not kept:
        raise SystemExit(f"no train.py log interval starts at or after step {steps // 3}; raise --steps")
    return min(k[0] for k in kept), sum(kept.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accelerate_repo", required=True, help="a checkout of accelerate at the installed version")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per run (at most one epoch: 159)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each, alternated")
    args = ap.parse_args()
    example_file = Path(args.accelerate_repo) / EXAMPLE
    if not example_file.is_file():
        refuse(f"--accelerate_repo {args.accelerate_repo} has no {EXAMPLE}; clone accelerate and check out v1.15.0")
    if args.steps < 12:
        refuse(f"--steps {args.steps} leaves no steady state after train.py's first log steps; use at least 12")
    source = example_file.read_bytes()
    patched = patched_example(source.decode())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare_docs(str(tmp))
        meta = token_data.read_meta(data)
        steps_per_epoch = (meta["splits"]["train"]["tokens"] - 1) // SEQ_LEN // (MICRO_BATCH * PROCESSES)
        if args.steps > steps_per_epoch:
            refuse(
                f"--steps {args.steps} is more than one epoch ({steps_per_epoch} steps) of this data: the "
                f"example would evaluate and save inside the timed steps; use --steps {steps_per_epoch} or fewer"
            )
        script = tmp / EXAMPLE.name
        script.write_text(patched)
        write_text_splits(data, tmp / "text")
        models.load_model_config(MODEL, "", SEQ_LEN, meta).save_pretrained(tmp / "mini_config")
        rounds = []
        for r in range(args.rounds):
            ex = example_round(script, tmp / "text", tmp / "mini_config", data, tmp / f"example{r}", args.steps)
            tp = train_py_round(data, tmp / f"train_py{r}", args.steps)
            if ex["windows"] != tp["windows"]:
                raise SystemExit(f"the example trains on {ex['windows']} windows, train.py on {tp['windows']}")
            first, train_py_s = steady_window(tp["intervals_s"], args.steps)
            example_s = ex["clock"][args.steps] - ex["clock"][first]
            rounds.append(
                {
                    "example_steps_per_s": (args.steps - first) / example_s,
                    "train_py_steps_per_s": (args.steps - first) / train_py_s,
                    "steady_steps": f"{first + 1}-{args.steps}",
                    "example_teardown_abort": ex["teardown_abort"],
                }
            )
            print(
                f"round {r}: example {rounds[-1]['example_steps_per_s']:.3f} steps/s, train.py "
                f"{rounds[-1]['train_py_steps_per_s']:.3f} steps/s",
                flush=True,
            )
    ratio = statistics.median(x["train_py_steps_per_s"] / x["example_steps_per_s"] for x in rounds)
    tokens_per_step = MICRO_BATCH * SEQ_LEN * PROCESSES
    result = {
        "setup": f"{PROCESSES} CPU processes, accelerate_configs/zero3_cpu.yaml, fp32, {MODEL}, {MICRO_BATCH} x "
        f"{SEQ_LEN} tokens per process, {args.steps} steps, {args.rounds} rounds alternated, python-docs BPE 8192",
        "example": f"{EXAMPLE} (git blob {git_blob_sha1(source)[:12]}) from accelerate "
        f"{checkout_version(Path(args.accelerate_repo))}",
        "accelerate_installed": accelerate.__version__,
        "patches": [why for why, _, _ in PATCHES],
        "tokens_per_step": tokens_per_step,
        "rounds": rounds,
        "example_tokens_per_s": statistics.median(x["example_steps_per_s"] for x in rounds) * tokens_per_step,
        "train_py_tokens_per_s": statistics.median(x["train_py_steps_per_s"] for x in rounds) * tokens_per_step,
        "ratio_train_py_vs_example": ratio,
    }
    record("vs_accelerate_example", result)
    print(
        f"train.py / accelerate's deepspeed_with_config_support.py (steady steps/s, median of {args.rounds} "
        f"rounds): {ratio:.3f}; {result['setup']}; on {machine()}"
    )


if __name__ == "__main__":
    main()
