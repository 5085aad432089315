"""prepare_data.py and the data format (lmdata.py): pure functions, real runs, and every bad input."""

import json
import shutil
import sys
import time

import numpy as np
import pytest

import lmdata
import prepare_data
from conftest import WIKITEXT2, needs_wikitext, run

PREPARE = [sys.executable, "prepare_data.py"]
WIKI = " \n = Alpha = \n \n Alpha text . \n \n = = Section = = \n \n More alpha . \n \n = Beta = \n \n Beta text . \n"


# --- pure functions ----------------------------------------------------------------------------------------------

def test_wikitext_articles_split_at_top_level_titles_only():
    docs = lmdata.split_wikitext_articles(WIKI)
    assert [d.splitlines()[0] for d in docs] == [" = Alpha = ", " = Beta = "]
    assert "= = Section = =" in docs[0] and "More alpha" in docs[0]
    assert "".join(docs) == WIKI[len(" \n"):]  # every byte after the first title is kept, once


def test_blank_line_blocks():
    assert lmdata.split_blank_line_blocks("a b\nc\n\n \n\nd\n\n") == ["a b\nc", "d"]


def test_token_dtype_boundary():
    assert lmdata.token_dtype(65536) == np.uint16
    assert lmdata.token_dtype(65537) == np.uint32
    assert lmdata.token_dtype(102400) == np.uint32


def test_held_out_slice_is_deterministic_and_sized():
    assert lmdata.held_out_indices(100, 0.05) == lmdata.held_out_indices(100, 0.05)
    assert len(lmdata.held_out_indices(100, 0.05)) == 5
    assert len(lmdata.held_out_indices(10, 0.01)) == 1  # at least one document
    train, held = lmdata.split_held_out([str(i) for i in range(20)], 0.1)
    assert len(train) == 18 and len(held) == 2 and not set(train) & set(held)


def test_windows_and_sample_order():
    tokens = np.arange(101)
    assert lmdata.num_windows(101, 10) == 10
    assert lmdata.window(tokens, 3, 10).tolist() == list(range(30, 41))  # seq_len + 1 tokens, overlapping by one
    n = 7
    epoch0 = [lmdata.sample_window(5, i, n) for i in range(n)]
    epoch1 = [lmdata.sample_window(5, i, n) for i in range(n, 2 * n)]
    assert sorted(w for _, w in epoch0) == list(range(n)) and sorted(w for _, w in epoch1) == list(range(n))
    assert {e for e, _ in epoch0} == {0} and {e for e, _ in epoch1} == {1}
    assert [w for _, w in epoch0] != [w for _, w in epoch1]
    assert lmdata.sample_window(5, 9, n) == lmdata.sample_window(5, 9, n)


def test_bpe_spec():
    assert prepare_data.parse_bpe_spec("bpe:8192") == 8192
    assert prepare_data.parse_bpe_spec("gpt2") is None
    for bad in ("bpe:abc", "bpe:", "bpe:10"):
        with pytest.raises(lmdata.DataError, match="bpe:"):
            prepare_data.parse_bpe_spec(bad)


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"good \xff\xfe text \xef\xbf\xbd kept\n")  # two bad bytes and one real U+FFFD
    text, replaced = lmdata.read_text(f)
    assert replaced == 2 and text.count("\ufffd") == 3


# --- the reader refuses what disagrees with meta.json ---------------------------------------------------------------

def test_reader_checks_size_dtype_and_version(docs_data, tmp_path):
    meta = lmdata.read_meta(docs_data)
    train = lmdata.load_split(docs_data, "train", meta)
    assert len(train) == meta["splits"]["train"]["tokens"] and train.dtype == np.uint16
    bad = tmp_path / "bad"
    shutil.copytree(docs_data, bad)
    with open(bad / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(lmdata.DataError, match="truncated or foreign"):
        lmdata.load_split(bad, "train")
    for key, value, match in (("format_version", 99, "format version"), ("dtype", "uint32", "dtype")):
        m = json.loads((docs_data / "meta.json").read_text())
        m[key] = value
        (bad / "meta.json").write_text(json.dumps(m))
        with pytest.raises(lmdata.DataError, match=match):
            lmdata.read_meta(bad)
    with pytest.raises(lmdata.DataError, match="no meta.json"):
        lmdata.read_meta(tmp_path)


# --- real runs ----------------------------------------------------------------------------------------------------

def test_python_docs_needs_no_network_or_files(docs_data):
    meta = json.loads((docs_data / "meta.json").read_text())
    assert set(meta["splits"]) == {"train", "validation"}
    assert meta["sources"][0]["spec"] == "python-docs" and len(meta["sources"][0]["sha256"]) == 64
    assert meta["splits"]["train"]["bytes"] > 1_000_000  # ~1.9 MB of English on Python 3.11
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    tokens = lmdata.load_split(docs_data, "train", meta)
    assert int((np.asarray(tokens) == meta["eos_id"]).sum()) == meta["splits"]["train"]["documents"]
    assert tokens[-1] == meta["eos_id"]
    held = [json.loads(line)["text"] for line in (docs_data / "validation.jsonl").read_text().splitlines()]
    assert len(held) == meta["splits"]["validation"]["documents"]
    assert sum(len(d.encode()) for d in held) == meta["splits"]["validation"]["bytes"]


def test_second_identical_run_is_a_no_op(docs_data):
    before = (docs_data / "train.bin").stat().st_mtime_ns
    t0 = time.perf_counter()
    proc = run(PREPARE + ["--dataset", "python-docs", "--tokenizer", "bpe:512", "--output_dir", docs_data,
                          "--validation_fraction", "0.05", "--num_proc", "2"])
    assert "up to date" in proc.stdout
    assert (docs_data / "train.bin").stat().st_mtime_ns == before
    assert time.perf_counter() - t0 < 60  # seconds, not a re-tokenization (generous: a loaded CI machine)


def test_other_inputs_need_overwrite(docs_data):
    proc = run(PREPARE + ["--dataset", "python-docs", "--tokenizer", "bpe:600", "--output_dir", docs_data], check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr


@needs_wikitext
def test_wikitext2_round_trip_and_counts(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "wt2"
    run(PREPARE + ["--dataset", str(WIKITEXT2), "--tokenizer", "bpe:8192", "--output_dir", out])
    meta = lmdata.read_meta(out)
    assert set(meta["splits"]) == {"train", "validation", "test"}
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    eos = meta["eos_id"]
    test_tokens = np.asarray(lmdata.load_split(out, "test", meta))
    first_doc = test_tokens[: int(np.argmax(test_tokens == eos))].tolist()
    articles = {
        "test": lmdata.split_wikitext_articles((WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8")),
        "validation": lmdata.split_wikitext_articles((WIKITEXT2 / "wiki.valid.raw").read_text(encoding="utf-8")),
        "train": lmdata.split_wikitext_articles((WIKITEXT2 / "wiki.train.tokens").read_text(encoding="utf-8")),
    }
    assert tok.decode(first_doc) == articles["test"][0]
    assert articles["test"][0].startswith(" = Robert Boulter = \n")
    for split, docs in articles.items():
        expected = sum(len(ids) for ids in tok(docs, add_special_tokens=False)["input_ids"]) + len(docs)
        assert meta["splits"][split]["tokens"] == expected, split
        assert meta["splits"][split]["documents"] == len(docs)


@needs_wikitext
def test_hub_wikitext_rows_give_the_documents_of_the_local_file(tmp_path):
    """Salesforce/wikitext stores a row per line with blank lines as empty strings: a Parquet fixture in that layout
    goes through the same code as a Hub download and must give the local raw file's documents byte for byte."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = (WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8")
    rows = [line + "\n" if line.strip() else "" for line in raw.split("\n")[:-1]]
    assert len(rows) == 4358  # the Hub's row count for this split
    shard = tmp_path / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.table({"text": rows}), shard)
    dsd = datasets.load_dataset("parquet", data_files={"test": str(shard)}, cache_dir=str(tmp_path / "cache"))
    hub = lmdata.hub_documents("wikitext-2", dsd)["test"]
    local, _ = lmdata.load_source(str(WIKITEXT2 / "wiki.test.raw"))
    assert hub == local["train"] and len(hub) == 62


def test_several_sources_jsonl_parquet_and_replaced_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": f"record {i} " * 20}) + "\n" for i in range(30)))
    pq.write_table(pa.table({"body": [f"row {i} " * 20 for i in range(20)]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_bytes(b"plain text with a bad byte \xff here\n" * 20)
    out = tmp_path / "out"
    proc = run(PREPARE + ["--dataset", str(tmp_path / "a.jsonl"), "--dataset", str(tmp_path / "b.parquet"),
                          "--dataset", str(tmp_path / "c.txt"), "--text_field", "body", "--tokenizer", "bpe:300",
                          "--output_dir", out, "--validation_fraction", "0.1"])
    meta = lmdata.read_meta(out)
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"]
    assert docs == 30 + 20 + 1  # a .txt file is one document
    assert [s["replaced_bytes"] for s in meta["sources"]] == [0, 0, 20]
    assert "20 undecodable bytes" in proc.stderr


# --- bad input: one-line error, exit 2, nothing written ---------------------------------------------------------------

def bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"content": "x"}\n')
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    (wiki / "wiki.train.raw").write_text(WIKI * 5)
    (wiki / "wiki.valid.raw").write_text(" \n")
    return {
        "missing path": (["--dataset", str(tmp_path / "nope.txt")], "neither an existing file"),
        "empty corpus": (["--dataset", str(tmp_path / "empty.txt")], "empty corpus"),
        "empty split": (["--dataset", str(wiki)], "validation split is empty"),
        "no text field": (["--dataset", str(tmp_path / "nofield.jsonl")], "no 'text' field"),
        "unknown preset": (["--dataset", "wikitext-5"], "known preset"),
        "bpe not a number": (["--dataset", "python-docs", "--tokenizer", "bpe:lots"], "bpe: takes a vocabulary size"),
        "hub offline": (["--dataset", "wikitext-103"], "local copy"),
    }


@pytest.mark.parametrize("case", ["missing path", "empty corpus", "empty split", "no text field", "unknown preset",
                                  "bpe not a number", "hub offline"])
def test_bad_input_fails_cleanly(tmp_path, case):
    args, message = bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    t0 = time.perf_counter()
    # HF_ENDPOINT at a closed local port: "offline" on any machine, and it must fail fast, not retry for minutes.
    proc = run(PREPARE + args + ["--output_dir", out], check=False,
               env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output dir, no partial dir
    assert time.perf_counter() - t0 < 60


def test_bpe_trains_from_lists_and_arrow_datasets():
    import datasets

    arrow = datasets.Dataset.from_dict({"text": ["hello world " * 50, "another document " * 40] * 10})
    tok = prepare_data.load_tokenizer("bpe:300", [arrow, ["a plain list document"]])
    assert tok.eos_token == prepare_data.BPE_EOS and tok.bos_token_id == tok.eos_token_id
    text = "hello world, another document!\n  spaced"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: exact round trip
