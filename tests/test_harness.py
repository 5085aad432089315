"""eval.py against lm-evaluation-harness itself, not a reimplementation of it: the same model, the same 62 WikiText-2
test pages and the harness's own `wikitext` task definition (its detokenizer and process_results), read from a local
JSONL because the Hub is out of reach. Word perplexity, byte perplexity and bits per byte must agree to 1e-6."""

import pytest
import torch
from common import harness_command, read_harness_results, write_harness_wikitext_task
from conftest import WIKITEXT2, needs_wikitext, run

import eval as ev
from deepseek_zero3.prepare import documents


def test_harness_pages_split_at_titles_and_drop_the_newline():
    text = " \n = A = \n \n a text . \n \n = = S = = \n \n more \n = B = \n \n b \n"
    pages = documents.harness_wikitext_pages(text)
    # The blank line before the first title is a whitespace-only page of its own, and is dropped.
    assert pages == [" = A = \n \n a text . \n \n = = S = = \n \n more ", " = B = \n \n b \n"]


def test_hub_rows_give_back_the_raw_file():
    raw = " \n = A = \n \n a . \n"
    rows = ["", " = A = \n", "", " a . \n"]  # the Hub's layout: a row a line, blank lines as empty strings
    assert documents.wikitext_text_from_rows(rows) == raw
    assert documents.wikitext_text_from_rows([r.rstrip("\n") for r in rows]) == raw  # rows without their newline too


@needs_wikitext
def test_pages_are_the_harness_datasets():
    """EleutherAI/wikitext_document_level's test split, as counted from the Hub: 62 pages, 1,290,527 bytes,
    241,335 words."""
    pages = documents.harness_wikitext_pages((WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8"))
    assert len(pages) == 62
    assert sum(len(p.encode("utf-8")) for p in pages) == 1_290_527
    assert sum(ev.word_count(p) for p in pages) == 241_335


@pytest.fixture(scope="module")
def tied_gpt2(docs_data, tmp_path_factory):
    """A second architecture: GPT-2 (learned positions, tied embeddings), 128-token context so pages span many
    windows."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(docs_data / "tokenizer")
    torch.manual_seed(1)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=512,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=128,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    assert model.config.tie_word_embeddings
    out = tmp_path_factory.mktemp("gpt2") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def harness_wikitext(model_dir, tmp_path, n_pages: int) -> dict:
    """`lm_eval --tasks wikitext` as a user runs it, on a local JSONL of the first n_pages pages instead of the Hub
    dataset."""
    pages = documents.harness_wikitext_pages((WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8"))[:n_pages]
    task = tmp_path / "task"
    name = write_harness_wikitext_task(pages, task)
    out = tmp_path / "harness"
    run(harness_command(model_dir, task, name, 8, out), env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    return read_harness_results(out, name)


@needs_wikitext
@pytest.mark.parametrize("which", ["trained llama", "tied gpt2"])
def test_eval_equals_lm_evaluation_harness(which, trained, tied_gpt2, tmp_path):
    """The first 16 of the test split's 62 pages for the trained model (all 62 took the harness about 80 s on 2 cores;
    bench/eval_vs_harness.py scores the whole split); the second architecture, whose 128-token context makes the
    harness score many more windows, on the first 8. The pages themselves: test_pages_are_the_harness_datasets."""
    model_dir, n_pages = (trained / "final", 16) if which == "trained llama" else (tied_gpt2, 8)
    harness = harness_wikitext(model_dir, tmp_path, n_pages)
    ours = ev.evaluate(
        ev.Config(model=str(model_dir), dataset=str(WIKITEXT2 / "wiki.test.raw"), split="test", dtype="float32",
                  batch_size=8, max_documents=n_pages)  # fmt: skip
    )
    assert ours["documents"] == n_pages and ours["text_transform"] == ev.HARNESS_TRANSFORM
    pages = documents.harness_wikitext_pages((WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8"))
    assert ours["bytes"] == sum(len(p.encode("utf-8")) for p in pages[:n_pages])  # the harness's pages, as it reads
    print(
        f"\n{which}: harness {harness}\n{which}: eval.py word {ours['word_perplexity']} byte {ours['byte_perplexity']} "
        f"bpb {ours['bits_per_byte']}"
    )
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours[key] == pytest.approx(harness[key], rel=1e-6), key
