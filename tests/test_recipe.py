"""DeepSeek's recipe: the LR schedules (cosine, multistep, WSD, a decay branch), the scaling laws of the plan, bits per
byte. The real runs: one ZeRO-3 process on the shared two-source data, a WSD run, a decay branch from its constant
phase, a resume inside its decay, eval.py on its final model."""

import hashlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
from conftest import TINY, launch, metrics, run, train_records

import train
from deepseek_zero3.recipe import scaling
from deepseek_zero3.recipe.schedule import Schedule, first_step_past
from deepseek_zero3.training_data import token_data


def test_multistep_is_deepseeks_shape():
    """DeepSeek LLM Sec. 2.3: warmup, the peak, x0.316 once 80% of the tokens are trained on, x0.316 again at 90%."""
    s = Schedule(1.0, 20, 1000, 0.1, "multistep")
    assert [s.lr(i) for i in (0, 18, 19)] == pytest.approx([1 / 20, 19 / 20, 1.0], rel=1e-12)  # warmup ends on 19
    assert s.lr(799) == 1.0 and s.lr(800) == pytest.approx(0.316) and s.lr(899) == pytest.approx(0.316)
    assert s.lr(900) == pytest.approx(0.316**2) and s.lr(5000) == pytest.approx(0.316**2)
    assert first_step_past(0.8, 10) == 8 and first_step_past(0.9, 10) == 9  # 0.8 x 10 is 8.000000000000002
    other = Schedule(2.0, 0, 100, 0.1, "multistep", multistep_at=(0.5,), multistep_factor=0.1)
    assert other.lr(49) == 2.0 and other.lr(50) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "shape, mid", [("linear", 0.55), ("1-sqrt", 1 - 0.9 * math.sqrt(0.5)), ("cosine", 0.55)]
)  # fmt: skip
def test_wsd_decays_over_its_last_fraction(shape, mid):
    """Warmup 2, 20 steps, the last 20% (4 steps, 16-19) decaying to the floor 0.1 in the given shape."""
    s = Schedule(1.0, 2, 20, 0.1, "wsd", decay_fraction=0.2, decay_shape=shape)
    assert [s.lr(i) for i in (0, 1, 15)] == [0.5, 1.0, 1.0]
    assert s.lr(17) == pytest.approx(mid) and s.lr(19) == pytest.approx(0.1) and s.lr(30) == pytest.approx(0.1)
    assert all(s.lr(i) > s.lr(i + 1) for i in range(15, 19))


@pytest.mark.parametrize("kind", ["cosine", "multistep", "wsd"])
def test_a_warmup_longer_than_the_schedule_is_shortened_so_it_decays(kind):
    """Issue #59: --max_steps 20 with the default --warmup_steps 30 warmed up for all 20 steps, never reaching the peak
    or decaying, while the console and the model card said "cosine to 0.0001 at step 20". The default warmup is
    shortened to a tenth of the schedule (given on the command line too: a smoke test keeps its command), so each kind
    does what describe() says."""
    from deepseek_zero3.recipe.schedule import fitted

    s, note = fitted(Schedule(1e-3, 30, 20, 0.1, kind), given=False)
    assert s.warmup_steps == 2 and f"--warmup_steps 30 (the default) does not fit the 20-step {kind} LR" in note
    lrs = [s.lr(i) for i in range(20)]
    assert lrs[1] == 1e-3 and lrs[-1] == pytest.approx(1e-4 if kind != "multistep" else 1e-3 * 0.316**2)
    assert "warmup 2 steps to 0.001" in s.describe()
    assert fitted(Schedule(1e-3, 30, 400, 0.1, kind), given=False) == (Schedule(1e-3, 30, 400, 0.1, kind), None)
    given, note = fitted(Schedule(1e-3, 30, 20, 0.1, kind), given=True)  # the same schedule: a pure function
    assert given == s and note.startswith(f"note: --warmup_steps 30 does not fit the 20-step {kind} LR schedule")
    short, _ = fitted(Schedule(1e-3, 30, 1, 0.1), given=False)  # one step: no room for a warmup or a decay
    assert short.describe() == "LR schedule cosine: no warmup, 0.001 for its one step" and short.lr(0) == 1e-3


@pytest.mark.slow
def test_a_short_run_with_the_default_warmup_decays_as_it_says(docs_data, tmp_path):
    """A real start (one process, 5 steps, --warmup_steps left at its default 30): the note, the schedule line, and the
    LRs the run logged, which reach the floor on the last step as the line says."""
    default_warmup = [a for i, a in enumerate(TINY) if "--warmup_steps" not in TINY[max(0, i - 1) : i + 1]]
    out = tmp_path / "out"
    proc = run([sys.executable, "train.py", *default_warmup, "--max_steps", "5", "--micro_batch_size", "2",
                "--data_dir", docs_data, "--output_dir", out, "--no_eval_at_start"])  # fmt: skip
    assert "note: --warmup_steps 30 (the default) does not fit the 5-step cosine LR schedule" in proc.stdout
    assert "LR schedule cosine: no warmup, cosine from 0.003 to 0.0003 at step 5" in proc.stdout, proc.stdout
    lrs = [r["lr"] for r in train_records(out).values()]
    assert lrs[0] == 3e-3 and lrs[-1] == pytest.approx(3e-4) and lrs == sorted(lrs, reverse=True)
    assert "cosine from 0.003 to 0.0003 at step 5" in (out / "final" / "README.md").read_text()


def test_a_shortened_warmup_resumes_without_a_change():
    """schedule_change_on_resume fits the checkpoint's schedule as the run did: resuming a 20-step run with the default
    warmup is no change of schedule."""
    from deepseek_zero3.recipe.schedule import fitted, schedule_change_on_resume

    schedule, _ = fitted(Schedule(1e-3, 30, 20, 0.1), given=False)
    state = {"step": 10, "total_steps": 20, "config": {"lr": 1e-3, "warmup_steps": 30, "min_lr_ratio": 0.1}}
    assert schedule_change_on_resume(schedule, state, set()) is None


def test_decay_branch_decays_from_where_the_schedule_was():
    s = Schedule(1.0, 2, 100, 0.1, "wsd", branch_at=50, branch_steps=4)
    assert [s.lr(i) for i in (49, 50, 51, 52, 53, 60)] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    cosine = Schedule(1.0, 2, 100, 0.1, branch_at=50, branch_steps=2, decay_shape="1-sqrt")
    top = Schedule(1.0, 2, 100, 0.1).lr(49)
    assert cosine.lr(49) == top and cosine.lr(50) == pytest.approx(0.1 + (top - 0.1) * (1 - math.sqrt(0.5)))


def test_branch_starts_where_the_lr_was_after_skipped_steps(tmp_path):
    """The schedule runs on the steps taken (train.py: lr(step - skipped)): a branch from a checkpoint at step 4 with
    one skipped step starts at schedule step 3, and still ends K steps after the checkpoint. A branch from the warmup,
    or longer than the run's schedule, is refused."""
    from deepseek_zero3.recipe.schedule import branch_settings
    from deepseek_zero3.run_dir.checkpoint import Resume

    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    resume = Resume(ckpt, {"step": 4, "skipped_steps": 1, "total_steps": 10, "config": {}})
    cfg = branch_settings(train.Config(decay_branch=3, warmup_steps=2, output_dir=str(tmp_path / "b")), set(), resume)
    assert (cfg.decay_start_step, cfg.max_steps, cfg.lr_decay_steps) == (3, 7, 10)
    for flags, named in (({"warmup_steps": 5}, "after the warmup (step 5 on)"), ({"decay_branch": 11}, "at most")):
        with pytest.raises(train.UserError, match=re.escape(named)):
            branch_settings(train.Config(**{"decay_branch": 3, "output_dir": str(tmp_path / "b"), **flags}), set(),
                            resume)  # fmt: skip
    # A 10-step run with the default --warmup_steps 30 warmed up for 1 step (schedule.fitted): step 4 is past it.
    assert branch_settings(train.Config(decay_branch=3, output_dir=str(tmp_path / "b")), set(), resume).max_steps == 7


def test_scaling_laws_reproduce_the_papers_table_2():
    """Eq. 1 at the compute of DeepSeek LLM 7B and 67B (M by Eq. 2 at a 4096-token context, 2T tokens) against the
    LR and batch of the paper's Table 2 (7B: 4.2e-4, 2304 x 4096 tokens; 67B: 3.2e-4, 4608 x 4096)."""
    for layers, width, lr, batch in ((30, 4096, 4.2e-4, 2304 * 4096), (95, 8192, 3.2e-4, 4608 * 4096)):
        compute = scaling.model_scale(layers, width, 4096) * 2e12
        assert scaling.optimal_lr(compute) == pytest.approx(lr, rel=0.03)
        assert scaling.optimal_batch_tokens(compute) == pytest.approx(batch, rel=0.1)
    # By hand: M = 72 x 30 x 4096^2 + 12 x 30 x 4096 x 4096 = 42,278,584,320; Eq. 4 splits C = M x D and
    # M_opt x D_opt = 0.1715 x 5.8316 C^(0.5243 + 0.4757) = 1.0001 C.
    assert scaling.model_scale(30, 4096, 4096) == 42_278_584_320
    m_opt, d_opt = scaling.optimal_scale(1e21)
    assert m_opt * d_opt == pytest.approx(1e21, rel=1e-3)


@pytest.mark.slow
def test_plan_prints_deepseeks_lines_for_7b():
    proc = run([sys.executable, "train.py", "--plan", "--model_config", "deepseek-7b", "--seq_len", "4096",
                "--max_steps", "1000", "--micro_batch_size", "1", "--lr", "1e-2", "--data_dir", "none"])  # fmt: skip
    tokens = 1000 * 4096 * 3  # the CPU config: 3 processes, micro-batch 1
    compute = scaling.model_scale(30, 4096, 4096) * tokens
    assert f"= {compute:.3g} FLOPs" in proc.stdout
    assert f"peak LR {scaling.optimal_lr(compute):.3g} (this run: 0.01)" in proc.stdout
    assert "advice: this run's peak LR is" in proc.stdout and "advice: this run's global batch is 1/" in proc.stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--lr_schedule", "step"], "--lr_schedule 'step' must be one of cosine, multistep, wsd"),
        (["--multistep_at", "0.9,0.8"], "--multistep_at '0.9,0.8' must be increasing fractions"),
        (["--decay_shape", "sqrt"], "--decay_shape 'sqrt' must be one of linear, 1-sqrt, cosine"),
        (["--decay_fraction", "0"], "--decay_fraction 0.0 must be in (0, 1]"),
        (["--decay_branch", "5"], "--decay_branch 5 decays from a checkpoint: give one with --resume"),
    ],
)
@pytest.mark.slow
def test_schedule_flags_refused_in_one_line(docs_data, tmp_path, flags, named):
    proc = run([sys.executable, "train.py", *TINY, "--data_dir", docs_data, "--output_dir", tmp_path / "o", *flags],
               check=False)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and named in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def digest(directory: Path, skip=()) -> str:
    h = hashlib.sha256()
    for p in sorted(p for p in directory.rglob("*") if p.name not in skip):
        h.update(str(p.relative_to(directory)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return h.hexdigest()


# --data_mix: not the default weights, which eval.py must then be given too
WSD = [*TINY, "--max_steps", "10", "--micro_batch_size", "4", "--lr_schedule", "wsd", "--decay_fraction", "0.4",
       "--save_every", "4", "--keep_last", "3", "--eval_every", "4", "--eval_tokens", "4096",
       "--data_mix", "python-docs=0.5,web.jsonl=0.5"]  # fmt: skip


@pytest.fixture(scope="module")
def wsd_run(docs_data, tmp_path_factory):
    """One ZeRO-3 process, 10 steps of WSD (warmup 2, the decay on steps 6-9), checkpoints at 4, 8 and 10, validation
    at 0, 4, 8 and 10. Returns OUT."""
    out = tmp_path_factory.mktemp("wsd") / "out"
    launch(1, *WSD, "--data_dir", docs_data, "--output_dir", out)
    return out


@pytest.mark.launch
def test_decay_branch_finishes_a_model_and_leaves_the_run_alone(wsd_run, docs_data, tmp_path):
    """From the constant phase (step 4), a 3-step decay into a new directory: the LR falls to the floor, the branch
    exports a model whose validation loss is below the checkpoint's, and the original directory is untouched."""
    before, branch = digest(wsd_run), tmp_path / "decayed"
    proc = launch(1, *WSD, "--data_dir", docs_data, "--output_dir", branch, "--resume",
                  wsd_run / "checkpoints" / "step_4", "--decay_branch", "3")  # fmt: skip
    assert digest(wsd_run) == before
    before = digest(wsd_run, skip={".lock"})  # which a command aimed at the run's directory takes
    assert "decay branch: from step 4 (0.003) to 0.0003 at step 7, linear" in proc.stdout
    records = train_records(branch)
    assert sorted(records) == [5, 6, 7] and records[7]["lr"] == pytest.approx(3e-4)
    assert records[5]["lr"] == pytest.approx(3e-4 + 2.7e-3 * 2 / 3)
    vals = {r["step"]: r["val_loss"] for r in metrics(wsd_run) if "val_loss" in r}
    final = [r["val_loss"] for r in metrics(branch) if "val_loss" in r][-1]
    assert final < vals[4] and (branch / "final" / "config.json").is_file()
    state = json.loads((branch / "checkpoints" / "step_7" / "trainer_state.json").read_text())
    assert state["config"]["decay_start_step"] == 4 and state["config"]["lr_decay_steps"] == 10
    for out, extra, named in ((wsd_run, [], "give a new --output_dir"),
                              (wsd_run / "inside", [], "give a new --output_dir outside"),
                              (branch, [], "holds one (its checkpoints or final/)"),  # a finished run: not overwritten
                              (tmp_path / "other", ["--max_steps", "20"], "drop --max_steps 20")):  # fmt: skip
        refused = run([sys.executable, "train.py", *WSD, "--data_dir", docs_data, "--output_dir", out, "--resume",
                       wsd_run / "checkpoints" / "step_4", "--decay_branch", "3", *extra], check=False)  # fmt: skip
        assert refused.returncode == 2 and named in refused.stderr.splitlines()[-1], refused.stderr[-2000:]
    assert digest(wsd_run, skip={".lock"}) == before


@pytest.mark.launch
def test_wsd_run_logs_the_schedule_and_resumes_inside_its_decay(wsd_run, docs_data):
    straight = train_records(wsd_run)
    expected = Schedule(3e-3, 2, 10, 0.1, "wsd", decay_fraction=0.4)
    assert [straight[s]["lr"] for s in range(1, 11)] == pytest.approx([expected.lr(i) for i in range(10)], rel=1e-12)
    assert straight[6]["lr"] == 3e-3 and straight[7]["lr"] < 3e-3 and straight[10]["lr"] == pytest.approx(3e-4)
    # The original run after the branch above (this file's tests run in order): resumed inside its decay, steps 9 and
    # 10 again, equal to the straight run's, as if it had never been branched.
    launch(1, *WSD, "--data_dir", docs_data, "--output_dir", wsd_run, "--resume", wsd_run / "checkpoints" / "step_8")
    again = train_records(wsd_run)
    for step in (9, 10):
        assert (again[step]["loss"], again[step]["lr"]) == (straight[step]["loss"], straight[step]["lr"]), step


@pytest.mark.launch
def test_val_bpb_equals_eval_py_and_the_card_holds_both(wsd_run, docs_data, tmp_path):
    """train.py's last val_bpb (and per source) against eval.py's packed scoring of OUT/final on the same windows,
    and its definition: the loss in bits over the validation split's UTF-8 bytes per token from meta.json. The model
    card of OUT/final (written by the resumed segment above, steps 9-10) as huggingface_hub reads it: the run's last
    validation and eval.py's scores (--update_card) in its model-index, and the tokens of all 10 steps."""
    last = [r for r in metrics(wsd_run) if "val_bpb" in r][-1]
    meta = token_data.read_meta(docs_data)
    source = meta["sources"][0]
    per_token = source["bytes"]["validation"] / source["tokens"]["validation"]
    name = source["name"]
    assert last[f"val_bpb/{name}"] == pytest.approx(last[f"val_loss/{name}"] / math.log(2) / per_token, rel=1e-12)
    assert sum(s["bytes"]["validation"] for s in meta["sources"]) == meta["splits"]["validation"]["bytes"]
    report = tmp_path / "eval.json"
    run([sys.executable, "eval.py", "--model", wsd_run / "final", "--dataset", docs_data, "--split", "validation",
         "--packed_seq_len", "32", "--eval_tokens", "4096", "--data_mix", "python-docs=0.5,web.jsonl=0.5",
         "--output_json", report, "--update_card"])  # fmt: skip
    scored = json.loads(report.read_text())
    for key in [k for k in last if k.startswith(("val_loss", "val_bpb"))]:
        assert scored[key] == pytest.approx(last[key], abs=1e-6), key
    from huggingface_hub import ModelCard

    card = ModelCard.load(wsd_run / "final" / "README.md")
    assert card.data.library_name == "transformers" and card.data.license == "unknown"
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results["validation loss (nats/token)"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert results["validation bits per byte"] == pytest.approx(last["val_bpb"], rel=1e-6)
    assert results["val_bpb (eval.py)"] == pytest.approx(scored["val_bpb"], rel=1e-6)
    assert re.search(r"1,280 tokens seen over 10 steps", card.text) and "resumed 1 time(s)" in card.text  # 10x4x32
    # The finished run launched again (a requeued job) trains nothing and keeps the card eval.py added to.
    text = (wsd_run / "final" / "README.md").read_text()
    launch(1, *WSD, "--data_dir", docs_data, "--output_dir", wsd_run, "--resume", "auto")
    assert (wsd_run / "final" / "README.md").read_text() == text
    assert train.Config().lr_schedule == "cosine"  # the default stays


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--update_card"], "holds no model card (README.md)"),
        (["--eval_tokens", "64"], "--eval_tokens and --data_mix go with --packed_seq_len"),
        (["--split", "validation", "--packed_seq_len", "32", "--eval_tokens", "5"], "--eval_tokens 5 is less than one"),
    ],
)
@pytest.mark.slow
def test_eval_flags_refused_before_scoring(docs_data, tmp_path, flags, named):
    proc = run([sys.executable, "eval.py", "--model", tmp_path, "--dataset", docs_data, *flags], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and named in errors[0], proc.stderr


def test_push_to_hub_is_checked_before_the_run_and_uploads_final(tmp_path, monkeypatch):
    """--push_to_hub: a bad repo id, offline mode and a missing token are refused before anything starts; the upload
    itself (which the tests cannot reach) goes through a stand-in for huggingface_hub's HfApi that records its calls."""
    from huggingface_hub import constants

    from deepseek_zero3.run_dir import card

    with pytest.raises(train.UserError, match="is not a Hub repo id"):
        card.check_push("not a repo/with spaces")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(train.UserError, match="HF_HUB_OFFLINE is set"):
        card.check_push("user/model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(train.UserError, match="no Hugging Face token"):
        card.check_push("user/model")
    calls = []

    class Api:
        def create_repo(self, repo, **kw):
            calls.append(("create", repo, kw))

        def upload_folder(self, **kw):
            calls.append(("upload", kw))
            return type("Info", (), {"commit_url": "https://huggingface.co/user/model/commit/1"})()

    assert card.push(tmp_path, "user/model", 10, api=Api()) == "https://huggingface.co/user/model/commit/1"
    assert calls[0] == ("create", "user/model", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][1]["folder_path"] == tmp_path and calls[1][1]["repo_id"] == "user/model"

    class Down(Api):
        def upload_folder(self, **kw):
            raise OSError("the network is down")

    assert card.push_final(tmp_path, "user/model", 10, api=Down()) is None  # train.py then exits 3, final/ kept


def test_update_card_keeps_the_rest_of_the_card(tmp_path):
    """eval.py's scores go into the card's table and model-index, replacing its own earlier scores of the same data and
    settings only: a user's rows and sections after the table stay; a README without front matter gets a model-index
    name; a card the Hub's parser refuses is refused before any evaluation."""
    from deepseek_zero3.run_dir import card

    (tmp_path / "README.md").write_text("# my model\n\nNotes.\n")
    report = {"dataset": "wikitext-2", "split": "test", "word_perplexity": 100.0, "bits_per_byte": 1.5, "seconds": 3.0}
    card.add_eval(tmp_path, report)
    text = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(text + "| mine | acc | 0.5000 |\n\n## Limitations\n\nSmall.\n")
    card.add_eval(tmp_path, {**report, "word_perplexity": 90.0})
    packed = {"dataset": str(tmp_path), "split": "validation", "packed_seq_len": 32, "val_loss": 5.0, "eval_tokens": 0}
    card.add_eval(tmp_path, packed)
    loaded = card.load_card(tmp_path)
    text = loaded.text
    assert "| wikitext-2 [test] | word_perplexity | 90.0000 |" in text and "100.0000" not in text
    assert "| mine | acc | 0.5000 |" in text and "## Limitations\n\nSmall." in text and "Notes." in text
    results = {(r.dataset_name, r.metric_name): r.metric_value for r in loaded.data.eval_results}
    assert results[("wikitext-2", "word_perplexity (eval.py)")] == 90.0 and len(results) == 3
    assert results[(f"{tmp_path.name} (packed 32, all tokens)", "val_loss (eval.py)")] == 5.0  # a name, not a path
    assert loaded.data.model_name == tmp_path.name
    (tmp_path / "README.md").write_text("---\nlicense: [unknown\n---\n# broken\n")
    with pytest.raises(train.UserError, match="is not a model card huggingface_hub reads"):
        card.check_card(tmp_path)


def test_card_times_the_steps_each_log_line_covers():
    """Time in training steps: each log record's tokens since the one before over its tokens/s; a decay branch's log
    starts at its checkpoint's step (its first record, the resume), not at step 0."""
    from deepseek_zero3.run_dir.card import training_seconds

    steps = [{"step": 5, "tokens": 500, "loss": 1.0, "tokens_per_s": 100.0},
             {"step": 7, "tokens": 700, "loss": 1.0, "tokens_per_s": 50.0}]  # fmt: skip
    assert training_seconds(steps) == 5 + 4
    assert training_seconds([{"step": 4, "event": "resume"}, *steps]) == 1 + 4
