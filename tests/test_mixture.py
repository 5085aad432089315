"""Sources kept apart, mixed by weight, and documents that attend only to themselves (issue #37).

docs_data (conftest) holds two sources of very different sizes, so every multi-process proof elsewhere (3 processes
== 1, accumulation, resume == straight, SIGTERM/SIGKILL, MoE) already runs on a mixture with document masking on.
Here: the mixture's arithmetic, its refusals, the masked forward against each document scored alone, and one run
mixed 0.5/0.5 that logs tokens and validation per source."""

import dataclasses
import json
import shutil
import sys
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, launch, metrics, run, train_records

import train
from deepseek_zero3.cli import UserError
from deepseek_zero3.model import attention, lmloss, models, mtp
from deepseek_zero3.run_dir import checkpoint
from deepseek_zero3.training_data import mixture, token_data

# --- the mixture's order ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [
        (Fraction(1, 2), Fraction(1, 2)),
        (Fraction(9, 10), Fraction(1, 10)),
        (Fraction(7, 10), Fraction(0), Fraction(3, 10)),
        (Fraction(123, 1000), Fraction(500, 1000), Fraction(377, 1000)),
    ],
    ids=str,
)
def test_every_prefix_holds_the_weights_to_one_sample(weights):
    order = [mixture.position(g, weights) for g in range(2000)]
    for s, w in enumerate(weights):
        ks = [k for source, k in order if source == s]
        assert ks == list(range(len(ks)))  # each source's samples in order, none skipped or repeated
    for g in range(0, 2001, 7):
        given = [sum(1 for source, _ in order[:g] if source == s) for s in range(len(weights))]
        assert given == mixture.counts(g, weights)
        assert all(abs(n - w * g) <= 1 for n, w in zip(given, weights)), (g, given)
    assert [mixture.position(g, weights) for g in (1999, 7, 1999)] == [order[1999], order[7], order[1999]]  # pure


def test_one_source_keeps_the_order_of_runs_before_mixtures():
    assert [mixture.position(g, (Fraction(1),)) for g in (0, 5, 10**12)] == [(0, 0), (0, 5), (0, 10**12)]
    assert token_data.sample_window(3, 17, 40) == token_data.sample_window(3, 17, 40, source=0)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("python-docs=0.9,wiki=0.1", "no source is named 'wiki'; the sources are python-docs, web.jsonl"),
        ("python-docs=-1,web.jsonl=1", "the weight of python-docs, '-1', is not a number of 0 or more"),
        ("python-docs=inf", "the weight of python-docs, 'inf', is not a number of 0 or more"),
        ("python-docs=0,web.jsonl=0", "gives every source weight 0"),
        ("python-docs:0.5", "is not name=weight"),
        ("python-docs=abc", "the weight of python-docs, 'abc', is not a number"),
        ("python-docs=1,python-docs=2", "gives python-docs twice"),
    ],
)
def test_bad_mixes_are_refused(spec, message):
    with pytest.raises(UserError, match=message):
        mixture.parse_mix(spec, ["python-docs", "web.jsonl"], [100, 10])


def test_default_mix_is_proportional_and_left_out_sources_get_nothing():
    assert mixture.parse_mix("", ["a", "b"], [300, 100]) == (Fraction(3, 4), Fraction(1, 4))
    assert mixture.parse_mix("b=2", ["a", "b"], [300, 100]) == (Fraction(0), Fraction(1))


# --- sources on disk ----------------------------------------------------------------------------------------------


def test_sources_are_kept_apart_and_old_directories_are_one_source(docs_data, tmp_path):
    meta = token_data.read_meta(docs_data)
    ranges = token_data.source_ranges(meta)
    assert [name for name, _ in ranges] == ["python-docs", "web.jsonl"]
    train_tokens = token_data.load_split(docs_data, "train", meta)
    for name, r in ranges:
        start, end = r["train"]
        assert end > start and train_tokens[end - 1] == meta["eos_id"]  # a source ends with its last document's EOS
    assert ranges[1][1]["train"][1] == meta["splits"]["train"]["tokens"]
    old = json.loads(json.dumps(meta))
    for source in old["sources"]:
        del source["tokens"], source["name"]
    whole = {split: (0, c["tokens"]) for split, c in meta["splits"].items()}
    assert token_data.source_ranges(old) == [("python-docs+web.jsonl", whole)]
    old["sources"][0]["tokens"] = {"train": 5, "validation": 0}
    old["sources"][1]["tokens"] = {"train": 5, "validation": 0}
    with pytest.raises(UserError, match="per-source token counts"):
        token_data.source_ranges(old)


@pytest.mark.slow
def test_directories_with_other_tokenizers_are_refused(docs_data, tmp_path):
    """The same --tokenizer spec is not the same tokenizer: a BPE trained on other text maps ids to other tokens."""
    web = docs_data.parent / "web.jsonl"
    other, shared = tmp_path / "other", tmp_path / "shared"
    run([sys.executable, "prepare_data.py", "--dataset", web, "--tokenizer", "bpe:512", "--output_dir", other])
    tokenizer = docs_data / "tokenizer"
    run([sys.executable, "prepare_data.py", "--dataset", web, "--tokenizer", tokenizer, "--output_dir", shared])
    both = token_data.training_data(f"{docs_data},{shared}", 32, 2048)
    assert [s.name for s in both.sources] == ["python-docs", "web.jsonl", "web.jsonl-2"]  # by order
    with pytest.raises(UserError, match=r"prepared with different tokenizers .*--tokenizer .*python-docs/tokenizer"):
        token_data.training_data(f"{docs_data},{other}", 32, 2048)
    with pytest.raises(UserError, match="names a directory twice"):
        token_data.training_data(f"{docs_data},{docs_data}/", 32, 2048)
    tiny_source = tmp_path / "tiny-source"
    shutil.copytree(docs_data, tiny_source)
    meta = json.loads((tiny_source / "meta.json").read_text())
    moved = meta["sources"][1]["tokens"]["train"] - 10  # web.jsonl keeps 10 training tokens, less than one window
    meta["sources"][0]["tokens"]["train"] += moved
    meta["sources"][1]["tokens"]["train"] -= moved
    (tiny_source / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="source web.jsonl has 10 training tokens, fewer than one window of --seq_len"):
        token_data.training_data(str(tiny_source), 32, 2048, "python-docs=0.5,web.jsonl=0.5")
    assert token_data.training_data(str(tiny_source), 32, 2048).weights == (1, 0)  # in proportion to its 0 windows


# --- document masking ---------------------------------------------------------------------------------------------


def test_document_positions_restart_after_each_eos():
    rows = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0]])
    assert lmloss.document_positions(rows, 0).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def masked_batch(docs_data, preset: str, seq_len: int = 256):
    """(train.Config, model config, (inputs, targets, positions) of 4 windows holding several documents each) from
    real data through train.py's get_batch."""
    mix = "python-docs=0.5,web.jsonl=0.5"
    cfg = train.Config(data_dir=str(docs_data), seq_len=seq_len, seed=1, data_mix=mix)
    data = token_data.training_data(cfg.data_dir, seq_len, 0, mix)
    eos = data.meta["eos_id"]
    ids = [i for i in range(400) if (token_data.sample_tokens(data, 1, i, seq_len)[:-2] == eos).any()][:4]
    assert len(ids) == 4, "no windows with several documents"
    return cfg, models.load_model_config(preset, "", seq_len, data.meta), train.get_batch(data, ids, cfg), eos


def built(model_config, kernel: str, checkpointing: bool = False):
    """A model of model_config with the attention kernel `kernel`, seeded alike for every kernel."""
    from transformers import AutoModelForCausalLM

    attention.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation=kernel, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("kernel", ["varlen_sdpa", "sdpa"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qk-norm", "deepseek-v3-tiny"])
@pytest.mark.slow
def test_masked_forward_equals_each_document_alone(docs_data, preset, kernel):
    """Windows of real data (two documents or more each) through train.py's get_batch: per-token losses of the masked
    forward equal each document's own forward from position 0, with varlen_sdpa (SDPA on each document, no mask:
    what `auto` takes on a CPU) and with the dense mask of the sdpa fallback; with masking off they do not; and
    train.py's loss (the chunked output layer) is their mean. (Seen failing: varlen_sdpa with every row taken as one
    document, 0.27 apart.)"""
    cfg, model_config, (inputs, targets, positions), eos = masked_batch(docs_data, preset)
    seq_len = inputs.shape[1]
    model = built(model_config, kernel).eval()
    with torch.no_grad():
        # as lmloss.model_nll calls it: with a cache (generation) transformers ignores packed position ids
        logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        unmasked = F.cross_entropy(model(input_ids=inputs).logits.transpose(1, 2), targets, reduction="none")
        alone = torch.zeros_like(per_token)
        for row in range(len(inputs)):
            starts = [0] + [t + 1 for t in range(seq_len - 1) if inputs[row, t] == eos]
            for a, b in zip(starts, starts[1:] + [seq_len]):
                logits = model(input_ids=inputs[row : row + 1, a:b]).logits
                alone[row, a:b] = F.cross_entropy(logits[0], targets[row, a:b], reduction="none")
        loss, logged = train.lm_loss(model, (inputs, targets, positions), cfg)
    assert (per_token - alone).abs().max() < 1e-5
    assert (unmasked - alone).abs().max() > 1e-2  # documents after the first see their predecessors unmasked
    assert float(loss) == float(logged["loss"]) == pytest.approx(float(per_token.mean()), rel=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-tiny"])
def test_masked_training_with_varlen_sdpa_equals_the_dense_mask(docs_data, preset):
    """train.py's loss and every gradient of a masked micro-batch (MTP depth included for DeepSeek-V3) with
    varlen_sdpa, with and without activation checkpointing, equal those of the dense-mask fallback within 1e-5.
    (Seen failing: varlen_sdpa with every row taken as one document, losses 1.3e-3 apart.)"""
    cfg, model_config, batch, _ = masked_batch(docs_data, preset)
    cfg = dataclasses.replace(cfg, mtp_depth=mtp.depth_of(-1, model_config))
    results = {}
    for kernel, checkpointing in (("sdpa", False), ("varlen_sdpa", False), ("varlen_sdpa", True)):
        model = built(model_config, kernel, checkpointing).train()
        if cfg.mtp_depth:
            mtp.attach(model, cfg.mtp_depth, 0)
        objective, logged = train.lm_loss(model, batch, cfg)
        objective.backward()
        results[kernel, checkpointing] = (float(objective), {n: p.grad for n, p in model.named_parameters()})
    dense_loss, dense_grads = results["sdpa", False]
    for key in (("varlen_sdpa", False), ("varlen_sdpa", True)):
        loss, grads = results[key]
        assert loss == pytest.approx(dense_loss, abs=1e-5), key
        assert grads.keys() == dense_grads.keys()
        worst = max(float((grads[n] - dense_grads[n]).abs().max()) for n in grads if grads[n] is not None)
        assert worst < 1e-5, (key, worst)


@pytest.mark.slow
def test_flex_attention_forward_keeps_documents_apart(docs_data):
    """transformers' FlexAttention path (what `auto` takes on a CUDA GPU without flash-attn) builds its block mask
    from the same position ids: forward only, as torch runs FlexAttention's backward on GPUs alone. Its masked
    per-token losses equal varlen_sdpa's within 1e-5 (compiled on the CPU: ~30 s)."""
    _, model_config, (inputs, targets, positions), _ = masked_batch(docs_data, "tiny", seq_len=128)
    per_token = {}
    for kernel in ("varlen_sdpa", "flex_attention"):
        model = built(model_config, kernel).eval()
        with torch.no_grad():
            logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        per_token[kernel] = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    assert (per_token["flex_attention"] - per_token["varlen_sdpa"]).abs().max() < 1e-5


# --- a run mixed 0.5 / 0.5 -----------------------------------------------------------------------------------------


@pytest.mark.launch
def test_run_mixes_sources_by_weight_and_reports_each(docs_data, tmp_path):
    """3 ZeRO-3 processes, 6 sequences per step from two sources of very different sizes mixed 0.5/0.5: each step
    takes exactly 3 of each; validation per source, the mixed loss their weighted mean; the plan's passes per source;
    a name the data lacks is refused in one line. (Resume == straight and 3 processes == 1 on a mixture: test_train's
    runs, whose docs_data is two sources.)"""
    out = tmp_path / "mixed"
    mix = ["--data_mix", "python-docs=0.5,web.jsonl=0.5"]
    args = [*TINY, "--micro_batch_size", "2", "--data_dir", docs_data, "--output_dir", out, *mix, "--eval_every", "2"]
    proc = launch(3, *args, "--max_steps", "4")
    assert "data mix: python-docs: 0.5 of the samples, " in proc.stdout
    assert "; web.jsonl: 0.5 of the samples, " in proc.stdout
    steps = train_records(out)
    assert sorted(steps) == [1, 2, 3, 4]
    for step, r in steps.items():
        assert r["tokens/python-docs"] == r["tokens/web.jsonl"] == step * 3 * 32
    vals = [r for r in metrics(out) if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    for r in vals:
        assert r["val_loss"] == pytest.approx(0.5 * r["val_loss/python-docs"] + 0.5 * r["val_loss/web.jsonl"])
    assert vals[-1]["val_loss/python-docs"] != vals[-1]["val_loss/web.jsonl"]
    bad_args = [*TINY, "--data_dir", docs_data, "--output_dir", tmp_path / "bad", "--data_mix", "wiki=1"]
    bad = run([sys.executable, "train.py", *bad_args], check=False)
    assert bad.returncode == 2 and "error: --data_mix 'wiki=1': no source is named 'wiki'" in bad.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_checkpoint_from_before_mixtures_resumes_as_it_ran(docs_data, tmp_path):
    """A checkpoint whose trainer_state has no data_mix (train.py before mixtures) read its directory as one stream and
    trained unmasked: resumed, it goes on that way, whatever the directory's meta.json now says."""
    out = tmp_path / "old"
    args = [*TINY, "--micro_batch_size", "2", "--max_steps", "2", "--save_every", "2", "--data_dir", docs_data,
            "--output_dir", out, "--no_document_masking"]  # fmt: skip
    run([sys.executable, "train.py", *args])
    state_path = out / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["data_mix"], state["config"]["data_mix"], state["config"]["document_masking"]
    state_path.write_text(json.dumps(state))
    checkpoint.write_manifest(state_path.parent)  # as that train.py wrote it
    resume = ["--output_dir", out, "--max_steps", "3", "--resume", "auto", "--lr_decay_steps", "2"]
    proc = run([sys.executable, "train.py", *resume])
    assert "settings from step_2:" in proc.stdout and "--no_document_masking" in proc.stdout
    assert "data mix:" not in proc.stdout  # one source: python-docs+web.jsonl
    saved = json.loads((out / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["data_mix"] == {"python-docs+web.jsonl": "1"} and saved["config"]["document_masking"] is False


# --- sources of the same name in several directories (issue #59) ----------------------------------------------------


def test_sources_of_the_same_name_are_named_by_their_order_not_their_directory(docs_data, tmp_path):
    """Two directories whose sources share names: the later ones are name-2 (as prepare_data.py names a source given
    twice), not DIRECTORY/name, so renaming or moving a directory changes no name, and a --data_mix keeps its keys. A
    checkpoint of the train.py that named them by directory is read by position when the data is the same (its
    fingerprint): its names, in its --data_mix too, become today's."""
    a, b = tmp_path / "a" / "python-docs", tmp_path / "b" / "python-docs"
    for d in (a, b):
        shutil.copytree(docs_data, d)
    names = ["python-docs", "web.jsonl", "python-docs-2", "web.jsonl-2"]
    data = token_data.training_data(f"{a},{b}", 32, 0, "python-docs=1,web.jsonl-2=3")
    assert [s.name for s in data.sources] == names and data.weights == (Fraction(1, 4), 0, 0, Fraction(3, 4))
    b.rename(tmp_path / "b" / "renamed")
    moved = token_data.training_data(f"{a},{tmp_path / 'b' / 'renamed'}", 32, 0, "python-docs=1,web.jsonl-2=3")
    assert [s.name for s in moved.sources] == names and moved.weights == data.weights
    assert moved.fingerprint == data.fingerprint
    legacy = ["python-docs", "web.jsonl", "python-docs/python-docs", "python-docs/web.jsonl"]
    known = {"names": legacy, "fingerprint": data.fingerprint}
    old = token_data.training_data(f"{a},{tmp_path / 'b' / 'renamed'}", 32, 0, "python-docs/web.jsonl=3,python-docs=1",
                                   known_as=known)  # fmt: skip
    assert old.weights == data.weights and old.renamed == dict(zip(legacy[2:], names[2:]))
    other = {"names": legacy, "fingerprint": "another"}  # other data: names are not matched by position
    with pytest.raises(UserError, match="no source is named 'python-docs/web.jsonl'"):
        token_data.training_data(f"{a},{tmp_path / 'b' / 'renamed'}", 32, 0, "python-docs/web.jsonl=3", known_as=other)


@pytest.mark.slow
def test_a_run_resumes_from_a_renamed_data_directory(docs_data, tmp_path):
    """Issue #59: a run over two directories whose sources share names, one directory renamed, then --resume auto:
    refused (its source names came from the directory names) and advised to start over with --init_from, losing the
    optimizer state. The checkpoint here is also one of the train.py before (its trainer_state.json names the second
    directory's sources by that directory), resumed by position; it trains the steps the straight run trained."""
    a, b = tmp_path / "a" / "python-docs", tmp_path / "b" / "python-docs"
    for d in (a, b):
        shutil.copytree(docs_data, d)
    args = [*TINY, "--micro_batch_size", "2", "--max_steps", "4", "--save_every", "2"]
    straight, out = tmp_path / "straight", tmp_path / "out"
    run([sys.executable, "train.py", *args, "--data_dir", f"{a},{b}", "--output_dir", straight])
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    shutil.rmtree(out / "final")
    (out / "checkpoints" / "latest").write_text("step_2\n")
    state_path = out / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    legacy = {"python-docs-2": "python-docs/python-docs", "web.jsonl-2": "python-docs/web.jsonl"}  # DIRECTORY/name
    state["data_mix"] = {legacy.get(name, name): weight for name, weight in state["data_mix"].items()}
    assert list(state["data_mix"]) == ["python-docs", "web.jsonl", "python-docs/python-docs", "python-docs/web.jsonl"]
    state_path.write_text(json.dumps(state))
    checkpoint.write_manifest(state_path.parent)  # as the train.py before wrote it
    renamed = b.rename(tmp_path / "b" / "docs-copy")
    proc = run([sys.executable, "train.py", "--output_dir", out, "--resume", "auto", "--data_dir", f"{a},{renamed}"])
    assert "sources named by position: python-docs/python-docs -> python-docs-2, python-docs/web.jsonl -> " \
           "web.jsonl-2" in proc.stdout, proc.stdout  # fmt: skip
    x, y = train_records(straight), train_records(out)
    assert [y[s]["loss"] for s in (3, 4)] == pytest.approx([x[s]["loss"] for s in (3, 4)], rel=1e-6)
    assert y[4]["tokens/web.jsonl-2"] == x[4]["tokens/web.jsonl-2"]
    saved = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert list(saved["data_mix"]) == ["python-docs", "web.jsonl", "python-docs-2", "web.jsonl-2"]
