"""A run's directory under damage (issue #20): train.py writes only into directories it created, resumes from the newest
checkpoint that verifies, treats torn and foreign files as what they are, and says in one `error:` line why it stops.

Most cases run `python train.py` in one process (no launcher, seconds per run): what they prove is the checkpoint and
directory handling, which is the same code under `accelerate launch`. The node-local MoE resume is in
test_multinode.py and the multi-process refusal here launches 2 processes.
"""

import hashlib
import json
import os
import re
import resource
import shutil
import sys
from pathlib import Path

import pytest
from common import synthetic_web_documents
from conftest import TINY, launch, run, train_records

RUN = [*TINY, "--micro_batch_size", "2", "--max_steps", "4", "--save_every", "2"]


def train(*args, check=True, env=None, **kw):
    return run([sys.executable, "train.py", *map(str, args)], check=check, env=env, **kw)


def tree(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its bytes: what "nothing changed" is checked against. Lock files aside:
    every start into OUT takes the lock and writes who holds it into it, before it reads anything else."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def assert_refused(proc, code: int | None, *needles: str) -> str:
    """Exit `code` (None: any failure, as `accelerate launch` reports it) and one `error:` line holding `needles`; no
    traceback of ours (the launcher prints its own after a worker fails)."""
    assert proc.returncode == code if code is not None else proc.returncode != 0, proc.stdout[-3000:] + proc.stderr
    lines = errors(proc)
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    if code is not None:
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def done_run(docs_data, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4, final/), in one process."""
    out = tmp_path_factory.mktemp("done") / "out"
    train(*RUN, "--data_dir", docs_data, "--output_dir", out)
    return out


def copy_run(done_run: Path, tmp_path: Path, keep_step_4: bool = False) -> Path:
    """A copy of the finished run; without step_4 and final/ it is a run stopped after its step-2 checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(done_run, out, symlinks=True)
    if not keep_step_4:
        shutil.rmtree(out / "checkpoints" / "step_4")
        shutil.rmtree(out / "final")
        (out / "checkpoints" / "latest").write_text("step_2\n")
    return out


@pytest.mark.slow
def test_resume_refuses_a_directory_train_py_did_not_write(docs_data, tmp_path):
    """Case 1: a folder with a `checkpoints/` of someone else's was taken for a run, its config.json replaced and its
    final/ deleted."""
    foreign = tmp_path / "U"
    (foreign / "checkpoints" / "ckpt-500").mkdir(parents=True)
    (foreign / "checkpoints" / "ckpt-500" / "weights.bin").write_bytes(b"\0" * 64)
    (foreign / "config.json").write_text('{"mine": true}\n')
    (foreign / "final").mkdir()
    (foreign / "final" / "important.txt").write_text("do not delete\n")
    before = tree(foreign)
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", foreign, "--resume", "auto", check=False)
    assert_refused(proc, 2, "no train.py run", "checkpoints/", "config.json", "final/")
    assert tree(foreign) == before


@pytest.mark.slow
def test_resume_auto_survives_what_a_crash_and_a_user_leave(done_run, docs_data, tmp_path):
    """Cases 8, 10, 11, 15 in one resume: a torn last metrics line, a user's backup folder in checkpoints/, a newest
    checkpoint with a truncated shard, leftovers of crashed saves. The run resumes from the newest intact checkpoint,
    says what it skipped and removed, leaves the user's folder alone, and trains the same steps as the straight run."""
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    ckpts = out / "checkpoints"
    shutil.rmtree(out / "final")
    shard = next(p for p in (ckpts / "step_4").iterdir() if p.name == "optimizer.bin")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    shutil.copytree(ckpts / "step_2", ckpts / "step_2.bak")
    backup = tree(ckpts / "step_2.bak")
    (ckpts / ".tmp-step_6").mkdir()
    (ckpts / ".step_2.stale").mkdir()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 6.1')  # the last line, cut short
    proc = train("--output_dir", out, "--resume", "auto")
    assert f"skipping checkpoint {ckpts / 'step_4'}: optimizer.bin has" in proc.stdout, proc.stdout
    assert f"resumed from {ckpts / 'step_2'} at step 2" in proc.stdout
    assert "dropped 1 torn line" in proc.stdout
    assert re.search(r"removed what earlier runs left unfinished in .*: \.step_2\.stale, \.tmp-step_6", proc.stdout)
    assert tree(ckpts / "step_2.bak") == backup
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_2", "step_2.bak", "step_4"]
    a, b = train_records(done_run), train_records(out)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-6)
    assert (out / "final" / "model.safetensors").is_file() and (out / "loss_curve.png").is_file()


@pytest.mark.slow
def test_explicit_resume_changes_nothing_until_the_load_succeeds(done_run, tmp_path):
    """Case 12: a checkpoint whose files are whole but whose contents are not (here: the optimizer state overwritten
    with zeros of the same size) fails to load; the newer checkpoints stay where they were and `latest` unchanged."""
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    ckpts = out / "checkpoints"
    bad = ckpts / "step_2" / "optimizer.bin"
    bad.write_bytes(b"\0" * bad.stat().st_size)
    before = tree(out)
    proc = train("--output_dir", out, "--resume", ckpts / "step_2", check=False)
    assert_refused(proc, 2, f"cannot load checkpoint {ckpts / 'step_2'}")
    assert tree(out) == before
    assert not list(ckpts.glob("abandoned-*"))


@pytest.mark.slow
def test_explicit_resume_of_a_damaged_checkpoint_is_refused(done_run, tmp_path):
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    ckpts = out / "checkpoints"
    (ckpts / "step_4" / "random_states_0.pkl").unlink()
    proc = train("--output_dir", out, "--resume", ckpts / "step_4", check=False)
    assert_refused(proc, 2, "random_states_0.pkl is missing", f"resume from {ckpts / 'step_2'}")


@pytest.mark.slow
def test_fine_tune_resumes_without_its_source(done_run, docs_data, tmp_path):
    """Case 9: a resumed --init_from run takes its weights and model config from the checkpoint, so it resumes after
    the source directory moved."""
    source = tmp_path / "source"
    shutil.copytree(done_run / "final", source)
    tuned = tmp_path / "tuned"
    train(*RUN, "--data_dir", docs_data, "--init_from", source, "--output_dir", tuned)
    straight = train_records(tuned)
    shutil.rmtree(tuned / "checkpoints" / "step_4")
    shutil.rmtree(tuned / "final")
    source.rename(tmp_path / "moved")
    proc = train("--output_dir", tuned, "--resume", "auto")
    assert "resumed from" in proc.stdout
    for step in (3, 4):
        assert train_records(tuned)[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-6)


@pytest.mark.slow
def test_init_from_refuses_another_tokenizer_of_the_same_size(done_run, tmp_path):
    """Case 3: a model trained on one 512-token BPE must not fine-tune on another 512-token BPE's ids."""
    corpus = tmp_path / "other.txt"
    corpus.write_text("\n\n".join(f"Document {i}: " + "lorem ipsum dolor sit amet " * (20 + i % 7) for i in range(300)))
    other = tmp_path / "other-data"
    run([sys.executable, "prepare_data.py", "--dataset", corpus, "--doc_separator", "blank_line", "--tokenizer",
         "bpe:512", "--output_dir", other])  # fmt: skip
    out = tmp_path / "out"
    proc = train(*RUN, "--data_dir", other, "--init_from", done_run / "final", "--output_dir", out, check=False)
    assert_refused(proc, 2, f"--init_from {done_run / 'final'} was trained with another tokenizer")
    assert not out.exists()


@pytest.mark.slow
def test_resume_in_another_precision_is_refused(done_run, tmp_path):
    """Case 13: an fp32 checkpoint resumed in bf16 died inside DeepSpeed looking for bf16 files."""
    out = copy_run(done_run, tmp_path)
    before = tree(out)
    proc = train("--output_dir", out, "--resume", "auto", check=False, env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert_refused(proc, 2, "precision='fp32'", "precision='bf16'", "relaunch with --mixed_precision no after")
    assert tree(out) == before


def limit_file_size(n_bytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


@pytest.mark.slow
def test_a_failed_checkpoint_write_names_the_path_and_keeps_the_last_checkpoint(docs_data, tmp_path):
    """Case 14: with `ulimit -f` (as a full disk would) the optimizer state cannot be written; the message names the
    checkpoint being written and the limit, and the previous checkpoint is the newest complete one."""
    out = tmp_path / "out"
    # Big enough for metrics, configs and the weights (0.67 MB), too small for the optimizer state (1.35 MB).
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", out, check=False, preexec_fn=limit_file_size(1_000_000))
    line = assert_refused(proc, 3, f"writing checkpoint {out / 'checkpoints' / '.tmp-step_2'} failed", "ulimit -f")
    assert "no earlier checkpoint exists" in line
    assert not (out / "checkpoints" / "step_2").exists() and not (out / "final").exists()


@pytest.mark.slow
def test_a_final_export_the_disk_refuses_stops_for_good_and_resumes(docs_data, tmp_path):
    """Issue #35: OUT/final written under a real file size limit fails in safetensors (SafetensorError, not an
    OSError): one line naming .tmp-final and the last complete checkpoint, exit 3 (under --max_restarts that stops
    the launcher instead of restarting into the same failure), no half-written final/; the message's advice,
    --resume auto, then exports it."""
    out = tmp_path / "out"
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", out, check=False,
                 env={"TRAIN_TEST_FAULT": "fsize_in_export:0:0"})  # fmt: skip
    assert_refused(proc, 3, f"writing the final model to {out / '.tmp-final'} failed: SafetensorError",
                   f"the last complete checkpoint, {out / 'checkpoints' / 'step_4'}, is intact")  # fmt: skip
    assert not (out / "final").exists() and not (out / ".tmp-final").exists()
    train("--output_dir", out, "--resume", "auto")
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_prepare_data_on_a_full_disk_is_one_line_and_keeps_its_work(tmp_path):
    """Issue #35: prepare_data.py writing past a file size limit (as on a full disk): one `error:` line, exit 3, the
    partial output kept for the same command to continue."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(synthetic_web_documents(1_500_000, seed=2)))
    args = ["--dataset", corpus, "--doc_separator", "blank_line", "--tokenizer", "bpe:300", "--num_proc", "1",
            "--output_dir", tmp_path / "out"]  # fmt: skip
    cmd = [sys.executable, "prepare_data.py", *map(str, args)]
    proc = run(cmd, check=False, preexec_fn=limit_file_size(200_000))
    assert_refused(proc, 3, f"writing a file under {tmp_path / '.out.partial'} failed", "a full disk or a file size")
    assert (tmp_path / ".out.partial").is_dir() and not (tmp_path / "out").exists()
    run(cmd)
    assert (tmp_path / "out" / "meta.json").is_file()


@pytest.mark.launch
def test_a_full_disk_on_one_rank_is_told_as_the_others_would(docs_data, tmp_path):
    """Issue #35: rank 1 alone finds its disk full while checkpoint 4 is written (rank 0 then waits for it and is
    killed by the launcher): its line names step_2 as the last complete checkpoint, as rank 0's would, not "no
    earlier checkpoint exists" (only the finalising rank used to look). Rank 0, when it sees the failure before the
    launcher ends it, says so in a line of its own that points at rank 1's (seen in CI's suite: two lines)."""
    out = tmp_path / "out"
    args = [*RUN, "--data_dir", docs_data, "--output_dir", out]
    # Rank 0, in a collective with the failed rank when the launcher's SIGTERM comes, can only be killed: after 5 s, not
    # the launcher's default 30 (seen: 40 s of the test's 48, under load 70).
    env = {"TRAIN_TEST_FAULT": "enospc_in_save:1:4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    proc = launch(2, *args, check=False, env=env)
    intact = f"{out}/checkpoints/step_2, is intact"
    rank0 = [e for e in errors(proc) if e.startswith("error: (rank 0) another process failed while checkpoint")]
    for line in rank0:
        assert "(its error line says why)" in line and intact in line, line
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if line not in rank0)
    assert_refused(proc, None, "(rank 1) writing checkpoint", ".tmp-step_4 failed: OSError", intact)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"


@pytest.mark.slow
def test_sigterm_while_saving_stops_after_that_checkpoint(docs_data, tmp_path):
    """Case 16: a stop signal that arrives while a checkpoint is written ends the run after it, not after one more step
    and a second checkpoint."""
    out = tmp_path / "out"
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", out, env={"TRAIN_TEST_FAULT": "sigterm_in_save:0:2"})
    assert "stopped by signal after step 2" in proc.stdout, proc.stdout[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2"]
    assert max(train_records(out)) == 2


@pytest.mark.launch
def test_setup_error_reaches_the_user_in_a_multi_process_launch(done_run, tmp_path):
    """Case 17: both ranks refuse a checkpoint of one plain process (no DeepSpeed) under ZeRO-3; whichever exits first,
    exactly one `error:` line is printed (the launcher used to kill rank 0 before it printed)."""
    out = copy_run(done_run, tmp_path)
    proc = launch(2, "--output_dir", out, "--resume", "auto", check=False)
    assert_refused(proc, None, "zero_stage=0", "zero_stage=3")


@pytest.mark.parametrize("damage", ["torn", "not an object", "empty"])
@pytest.mark.slow
def test_damaged_trainer_state_is_skipped_or_refused(done_run, tmp_path, damage):
    """A trainer_state.json cut short or replaced: --resume auto skips that checkpoint, an explicit --resume refuses.
    The whole resume runs once (torn); for the others, what --resume auto picks, in-process (the same function)."""
    from deepseek_zero3.run_dir import checkpoint

    out = copy_run(done_run, tmp_path, keep_step_4=True)
    shutil.rmtree(out / "final")
    state = out / "checkpoints" / "step_4" / "trainer_state.json"
    state.write_text({"torn": state.read_text()[:40], "not an object": "[1, 2]", "empty": ""}[damage])
    proc = train("--output_dir", out, "--resume", state.parent, check=False)
    assert_refused(proc, 2, f"cannot resume {state.parent}", "trainer_state.json")
    said = []
    assert checkpoint.newest_intact_checkpoint(out / "checkpoints", said.append).name == "step_2"
    assert said and "step_4" in said[0], said
    if damage == "torn":
        proc = train("--output_dir", out, "--resume", "auto")
        assert "resumed from" in proc.stdout and "step_2 at step 2" in proc.stdout


def test_output_dir_that_is_a_file(docs_data, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", a_file, check=False)
    assert_refused(proc, 2, f"--output_dir {a_file} is a file")
    assert a_file.read_text() == "mine\n"


def test_metrics_reader_drops_a_torn_last_line(tmp_path):
    from deepseek_zero3.run_dir import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    records, bad = metrics.read_metrics(path)
    assert [r["step"] for r in records] == [1, 2] and bad == 1
    assert metrics.truncate_metrics(path, 1) == 1
    assert json.loads(path.read_text()) == {"step": 1, "loss": 2.0}


def test_stray_names_in_checkpoints_are_never_parsed(tmp_path):
    from deepseek_zero3.run_dir import checkpoint

    for name in ("step_2", "step_10", "step_2.bak", "step_x", "abandoned-1", "step_3"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_4").write_text("a file")
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_2", "step_3", "step_10"]
    assert os.listdir(tmp_path)  # nothing removed


@pytest.mark.slow
def test_damaged_data_tokenizer_is_refused_before_the_model_is_built(docs_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(docs_data, data)
    tok = data / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text()[:100])
    out = tmp_path / "out"
    proc = train(*RUN, "--data_dir", data, "--output_dir", out, check=False)
    assert_refused(proc, 2, f"{data / 'tokenizer'} holds no readable tokenizer")
    assert not out.exists()


@pytest.mark.slow
def test_resume_auto_past_links_copies_and_names_that_are_not_its_own(done_run, tmp_path):
    """What a user or a copy tool leaves in checkpoints/: a symlinked step_N (its target damaged), a dangling symlink,
    a copy of step_2 under a newer name, a manifest that is not one, notes named like train.py's own leftovers. The
    run resumes from step_2 (the only true checkpoint), skips the rest with reasons, and deletes nothing of theirs."""
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    ckpts = out / "checkpoints"
    shutil.rmtree(out / "final")
    elsewhere = tmp_path / "elsewhere"
    (ckpts / "step_4").rename(elsewhere)
    (elsewhere / "optimizer.bin").write_bytes(b"\0" * 10)
    (ckpts / "step_4").symlink_to(elsewhere)
    (ckpts / "step_5").symlink_to(tmp_path / "nowhere")
    shutil.copytree(ckpts / "step_2", ckpts / "step_9")
    shutil.copytree(ckpts / "step_2", ckpts / "step_7")
    state = json.loads((ckpts / "step_7" / "trainer_state.json").read_text())
    (ckpts / "step_7" / "trainer_state.json").write_text(json.dumps({**state, "step": 7}))
    (ckpts / "step_7" / "manifest.json").write_text('{"files": []}')
    (ckpts / "abandoned-my-notes").mkdir()
    (ckpts / ".tmp-step_notes.txt").write_text("mine\n")
    proc = train("--output_dir", out, "--resume", "auto")
    assert "step_9: trainer_state.json says step 2, not 9" in proc.stdout, proc.stdout
    assert "step_7: manifest.json is unreadable" in proc.stdout
    assert f"resumed from {ckpts / 'step_2'} at step 2" in proc.stdout
    assert (ckpts / "abandoned-my-notes").is_dir() and (ckpts / ".tmp-step_notes.txt").read_text() == "mine\n"
    assert (elsewhere / "optimizer.bin").stat().st_size == 10  # the link was replaced, never what it points to
    assert (out / "final" / "model.safetensors").is_file()
    proc = train("--output_dir", out, "--resume", "auto", check=False)  # and the next start is not blocked
    assert proc.returncode == 2 and "beyond this run's 4 steps" in proc.stderr or proc.returncode == 0, proc.stderr


def odd_output_dirs(done_run: Path, tmp_path: Path) -> dict:
    def stopped():
        return copy_run(done_run, tmp_path)

    def all_damaged():
        out = stopped()
        (out / "checkpoints" / "step_2" / "optimizer.bin").write_bytes(b"")
        return out, "no checkpoint in"

    def checkpoints_a_file():
        out = tmp_path / "o"
        out.mkdir()
        (out / "train_run.json").write_text('{"written_by": "train.py"}')
        (out / "checkpoints").write_text("hi")
        return out, "checkpoints is not a directory"

    def marker_a_directory():
        out = stopped()
        (out / "train_run.json").unlink()
        (out / "train_run.json").mkdir()
        return out, "train_run.json is not a file"

    def dangling_output_dir():
        (tmp_path / "o").symlink_to(tmp_path / "nowhere")
        return tmp_path / "o", "which does not exist"

    def non_utf8_output_dir():
        return Path(os.fsdecode(bytes(tmp_path) + b"/x\xffy")), "is not valid UTF-8"

    def explicit_resume_state_without_tokens_seen():
        out = copy_run(done_run, tmp_path, keep_step_4=True)
        state = out / "checkpoints" / "step_2" / "trainer_state.json"
        state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "tokens_seen"}))
        (out / "checkpoints" / "step_2" / "manifest.json").unlink()  # as a checkpoint from before manifests
        return out, "has no valid tokens_seen"

    return {f.__name__: f for f in (all_damaged, checkpoints_a_file, marker_a_directory, dangling_output_dir,
                                     non_utf8_output_dir, explicit_resume_state_without_tokens_seen)}  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["all_damaged", "checkpoints_a_file", "marker_a_directory", "dangling_output_dir", "non_utf8_output_dir",
     "explicit_resume_state_without_tokens_seen"],
)  # fmt: skip
@pytest.mark.slow
def test_odd_output_directories_are_refused_in_one_line(done_run, docs_data, tmp_path, case):
    out, message = odd_output_dirs(done_run, tmp_path)[case]()
    before = tree(tmp_path)
    resume = out / "checkpoints" / "step_2" if case.startswith("explicit") else "auto"
    proc = train(*RUN, "--data_dir", docs_data, "--output_dir", out, "--resume", resume, check=False)
    assert_refused(proc, 2, message)
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_a_failed_metrics_write_names_the_file(done_run, tmp_path):
    from deepseek_zero3.run_dir import metrics

    """A full disk while appending to metrics.jsonl ends the run with the file named, exit 3, and the checkpoint it
    resumed from intact. Simulated with a file size limit just above metrics.jsonl, padded (with records of step 1,
    which the resume keeps) past every checkpoint file, so that the first write to fail is the next log line."""
    out = copy_run(done_run, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        for _ in range(1600):
            f.write(json.dumps({"step": 1, "note": "x" * 1000}) + "\n")
    metrics.truncate_metrics(out / "metrics.jsonl", 2)  # as the resume will: only the next log line grows it
    before = tree(out / "checkpoints")
    size = (out / "metrics.jsonl").stat().st_size
    proc = train("--output_dir", out, "--resume", "auto", check=False, preexec_fn=limit_file_size(size + 100))
    assert_refused(proc, 3, f"{out / 'metrics.jsonl'}: File too large")
    assert not list(out.glob(".*.tmp")) and tree(out / "checkpoints") == before


@pytest.mark.slow
def test_going_back_sets_the_newer_checkpoints_aside_and_a_requeue_continues(done_run, tmp_path):
    """Going back by hand to an older checkpoint of the run (here a user's copy of step_2 under another name in its
    checkpoints/: its trainer_state.json says which step it is) moves the checkpoints after it aside, with the
    history they belong to, and keeps them after the run finishes (they used to be deleted then). The same command
    again after a stop (a requeued job) continues the new branch from its newest checkpoint instead of going back
    again (it used to set that aside too, and the steps since)."""
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    ckpts = out / "checkpoints"
    copy = ckpts / "step_2.bak"
    shutil.copytree(ckpts / "step_2", copy)
    command = ["--output_dir", out, "--resume", copy, "--save_every", "1"]
    proc = train(*command, env={"TRAIN_TEST_FAULT": "sigterm_in_save:0:3"})
    moved = re.search(rf"moved the checkpoints after {copy.name} \(step_4\) to (\S+) .*kept until", proc.stdout)
    assert moved and "stopped by signal after step 3" in proc.stdout, proc.stdout
    aside = Path(moved.group(1))
    proc = train(*command)
    assert f"{ckpts / 'step_3'} continues the branch from {copy}" in proc.stdout, proc.stdout
    assert f"resumed from {ckpts / 'step_3'} at step 3" in proc.stdout
    assert f"kept in {ckpts}: {aside.name}, the checkpoints explicit" in proc.stdout
    assert [p.name for p in ckpts.glob("abandoned-*")] == [aside.name]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_4"]
    assert max(r["step"] for r in metrics_records(aside / "metrics.jsonl")) == 4  # the branch's history, to its end
    a, b = train_records(done_run), train_records(out)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-6)


def metrics_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_requeued_branch_continues_and_a_branch_never_takes_over_another_run(done_run, tmp_path):
    """Issue #59, case 1: B started from A's step_2 (`--resume A/checkpoints/step_2 --output_dir B`), stopped after
    step 3, then the same command again, as a requeued job script runs it: B continues from its own step_3 (it used to
    set B's newer checkpoints aside, cut its metrics back to step 2 and delete them at the end), and its losses are
    A's. Then B's checkpoint resumed into a directory that holds a run of its own (A's copy: step_4 and final/) is
    refused, nothing touched (A's newer checkpoints used to move aside: the original became the branch)."""
    a_before = tree(done_run)
    b = tmp_path / "B"
    command = ["--resume", done_run / "checkpoints" / "step_2", "--output_dir", b, "--save_every", "1"]
    proc = train(*command, env={"TRAIN_TEST_FAULT": "sigterm_in_save:0:3"})
    assert "stopped by signal after step 3" in proc.stdout, proc.stdout
    proc = train(*command)
    assert f"{b / 'checkpoints' / 'step_3'} continues the branch from" in proc.stdout, proc.stdout
    assert "resumed from step_3 (step 3); 0 step(s) logged after it were lost" in proc.stdout
    assert not list((b / "checkpoints").glob("abandoned-*"))
    a, records = train_records(done_run), train_records(b)
    assert sorted(records) == [3, 4]
    for step in (3, 4):
        assert records[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-6)
    assert tree(done_run) == a_before

    original = copy_run(done_run, tmp_path, keep_step_4=True)
    before = tree(original)
    proc = train("--resume", b / "checkpoints" / "step_3", "--output_dir", original, check=False)
    assert_refused(proc, 2, f"--output_dir {original} holds checkpoints of its own (newest step_4)", "--resume auto")
    assert tree(original) == before


@pytest.mark.slow
def test_explicit_resume_of_a_copy_outside_the_run_is_refused(done_run, tmp_path):
    """A user's copy of the run's step_2 kept outside it: resuming it into the run, which holds newer checkpoints of
    another line (step_4), is refused; resuming the run's own checkpoint (above) is how to go back."""
    out = copy_run(done_run, tmp_path, keep_step_4=True)
    copy = tmp_path / "elsewhere" / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", copy)
    before = tree(out)
    proc = train("--output_dir", out, "--resume", copy, check=False)
    assert_refused(proc, 2, f"--resume {copy}: --output_dir {out} holds checkpoints of its own (newest step_4)")
    assert tree(out) == before


def test_a_branch_set_aside_never_joins_an_older_one(tmp_path, monkeypatch):
    """Issue #59, case 12: after the wall clock stepped back, the name of a new abandoned-<time> folder is that of an
    older branch's; the new branch goes to a folder of its own (it used to be moved into the old one: "Directory not
    empty", or two branches mixed). The clock is the test's."""
    from deepseek_zero3.run_dir import checkpoint

    ckpts = tmp_path / "out" / "checkpoints"
    for step in (2, 4, 6):
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "weights").write_text(f"new branch, step {step}\n")
    older = ckpts / "abandoned-20260101-120000"
    (older / "step_4").mkdir(parents=True)
    (older / "step_4" / "weights").write_text("older branch\n")
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 6, "loss": 1.0}\n')
    monkeypatch.setattr(checkpoint.time, "strftime", lambda fmt, *a: fmt.replace("%Y%m%d-%H%M%S", "20260101-120000"))
    said = checkpoint.set_aside_newer(ckpts, ckpts / "step_2", 2)
    new = ckpts / "abandoned-20260101-120000-2"
    assert f"(step_4, step_6) to {new} " in said, said
    assert sorted(p.name for p in older.iterdir()) == ["step_4"] and (older / "step_4" / "weights").read_text() == (
        "older branch\n"
    )
    assert sorted(p.name for p in new.iterdir()) == ["metrics.jsonl", "step_4", "step_6"]
    assert (new / "step_4" / "weights").read_text() == "new branch, step 4\n"
    assert checkpoint.set_aside(ckpts) == [older, new]
    assert (ckpts / "latest").read_text() == "step_2\n"


@pytest.mark.slow
def test_a_validation_loss_past_a_float_perplexity_stops_the_run_as_diverged(done_run, tmp_path):
    """Issue #59, case 2: a run resumed at step 2 with an LR that blows the model up (--lr 1000, no clipping): the
    validation after step 3 gives a loss whose perplexity is past the largest float. The run stops as diverged (exit
    3, one line), the validation on record (its perplexity null), step_2 intact and still the newest (it used to end
    in an OverflowError traceback, exit 1, which every restart replayed)."""
    out = copy_run(done_run, tmp_path)
    step_2 = tree(out / "checkpoints" / "step_2")
    proc = train("--output_dir", out, "--resume", "auto", "--lr", "1000", "--max_grad_norm", "0", "--eval_every", "1",
                 check=False)  # fmt: skip
    line = assert_refused(proc, 3, "step 3: the validation loss is", "the run diverged", "--resume auto with a lower")
    val = [r for r in metrics_records(out / "metrics.jsonl") if "val_loss" in r][-1]
    assert val["step"] == 3 and val["val_loss"] > 709.8 and val["val_ppl"] is None, (val, line)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert not (out / "checkpoints" / "step_3").exists()
    assert tree(out / "checkpoints" / "step_2") == step_2


def deep_path(root: Path, n_bytes: int) -> Path:
    """A path of n_bytes under root, in names of 200 bytes (each allowed; the whole near PATH_MAX)."""
    path = str(root / "deep")
    while len(path) < n_bytes - 201:
        path += "/" + "d" * 200
    return Path(path + "/" + "e" * (n_bytes - len(path) - 1))


def unusable_paths(docs_data: Path, tmp_path: Path) -> dict:
    """Paths train.py cannot use, each with what its one line says. Before the checks: the long --output_dir trained
    until its first save and then advised freeing space; a name over 255 bytes failed in Python's own checks (exit 3,
    "complete checkpoints are intact ... --resume auto"); data behind a name that is not UTF-8 was "a tokenizer no
    one can read, rebuild the data"; a newline in a name broke the one error line in two."""
    not_utf8 = Path(os.fsdecode(bytes(tmp_path) + b"/data-\xff"))
    not_utf8.symlink_to(docs_data)
    newline = tmp_path / "a\nfile"
    newline.write_text("mine\n")
    return {
        "output_dir past PATH_MAX": (["--output_dir", deep_path(tmp_path, 4055)],
                                     ["is 4,055 bytes long, and train.py writes files up to 256 bytes below it",
                                      "bytes a path may have on that filesystem; choose a shorter path"]),
        "output_dir name past NAME_MAX": (["--output_dir", tmp_path / ("o" * 300)],
                                          ["a name of 300 bytes, over the 255 bytes a name may have"]),
        "resume name past NAME_MAX": (["--output_dir", tmp_path / "out", "--resume", tmp_path / ("c" * 256)],
                                      ["--resume", "a name of 256 bytes", "no file can have that name"]),
        "data_dir not UTF-8": (["--data_dir", not_utf8, "--output_dir", tmp_path / "out"],
                               [r"data-\udcff is not valid UTF-8", "rename it in UTF-8"]),
        "a newline in the name": (["--output_dir", newline], [r"a\nfile is a file, not a directory"]),
    }  # fmt: skip


@pytest.mark.parametrize("case", ["output_dir past PATH_MAX", "output_dir name past NAME_MAX",
                                  "resume name past NAME_MAX", "data_dir not UTF-8", "a newline in the name"])  # fmt: skip
@pytest.mark.slow
def test_paths_the_filesystem_cannot_take_are_refused_before_anything_is_written(docs_data, tmp_path, case):
    """Issue #59, case 3, and the class "a file's name is whatever bytes the filesystem allows"."""
    args, needles = unusable_paths(docs_data, tmp_path)[case]
    before = os.listdir(tmp_path)
    proc = train(*RUN, "--data_dir", docs_data, *args, check=False)
    assert_refused(proc, 2, *needles)
    assert os.listdir(tmp_path) == before


def test_a_write_refused_for_a_long_name_does_not_advise_freeing_space(tmp_path):
    """A checkpoint write the filesystem refuses for a name too long (a real ENAMETOOLONG) names the fix for that, not
    "free space" (which, with --resume auto, used to fail the same way)."""
    from deepseek_zero3.run_dir import checkpoint

    with pytest.raises(OSError) as refused:
        (tmp_path / ("x" * 300)).write_text("")
    line = str(checkpoint.write_failure(tmp_path / ".tmp-step_2", refused.value, tmp_path / "step_1"))
    assert "File name too long" in line and "free space" not in line, line
    assert "move the run directory to a shorter path and give that as --output_dir" in line, line


@pytest.mark.slow
def test_an_edited_model_config_is_refused_when_given_and_named_when_not(done_run, tmp_path):
    """Issue #59: a run started from a config file that was edited since (intermediate_size, rope_theta) resumed with
    no word when the command gave that file again: the model is the checkpoint's model_config.json, so the hash check
    could never differ. Given again, the edited file is refused with the fields that differ; not given (a preset
    edited for other runs), the run goes on with the checkpoint's model and a note says so. The run is the finished
    4-step run stopped after step 2, as if started with --model_config FILE (a copy of the tiny preset)."""
    out = copy_run(done_run, tmp_path)
    mine = tmp_path / "mine.json"
    tiny = json.loads((Path("model_configs") / "tiny.json").read_text())
    state_path = out / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["config"]["model_config"] = str(mine)
    state_path.write_text(json.dumps(state))
    from deepseek_zero3.run_dir import checkpoint

    checkpoint.write_manifest(state_path.parent)  # as train.py writes it for a run started with that file
    mine.write_text(json.dumps({**tiny, "intermediate_size": 352, "rope_theta": 500000.0}))
    before = tree(out)
    proc = train("--output_dir", out, "--resume", "auto", "--model_config", mine, check=False)
    line = assert_refused(proc, 2, f"cannot resume: --model_config {mine} builds another model than the checkpoint's")
    assert "intermediate_size 176 -> 352" in line and "rope_theta 10000.0 -> 500000.0" in line, line
    assert tree(out) == before
    proc = train("--output_dir", out, "--resume", "auto")
    assert f"note: --model_config {mine} has changed since the run started (intermediate_size 176 -> 352" in proc.stdout
    a, b = train_records(done_run), train_records(out)
    assert [b[step]["loss"] for step in (3, 4)] == pytest.approx([a[step]["loss"] for step in (3, 4)], rel=1e-6)
