"""prepare_data.py, its readers and the data format (documents.py, corpora.py, token_data.py): pure functions, real
runs, and every bad input."""

import json
import os
import shutil
import sys
import time

import numpy as np
import pytest
from common import synthetic_web_documents
from conftest import REPO, WIKITEXT2, docs_prepare_args, needs_wikitext, run

import prepare_data
from deepseek_zero3.cli import UserError
from deepseek_zero3.prepare import corpora, documents
from deepseek_zero3.training_data import token_data

PREPARE = [sys.executable, "prepare_data.py"]
WIKI = " \n = Alpha = \n \n Alpha text . \n \n = = Section = = \n \n More alpha . \n \n = Beta = \n \n Beta text . \n"


# --- pure functions ----------------------------------------------------------------------------------------------


def test_wikitext_articles_split_at_top_level_titles_only():
    docs = documents.split_wikitext_articles(WIKI)
    assert [d.splitlines()[0] for d in docs] == [" = Alpha = ", " = Beta = "]
    assert "= = Section = =" in docs[0] and "More alpha" in docs[0]
    assert "".join(docs) == WIKI[len(" \n") :]  # every byte after the first title is kept, once


def test_blank_line_blocks():
    assert documents.split_blank_line_blocks("a b\nc\n\n \n\nd\n\n") == ["a b\nc", "d"]


def test_token_dtype_boundary():
    assert token_data.token_dtype(65536) == np.uint16
    assert token_data.token_dtype(65537) == np.uint32
    assert token_data.token_dtype(102400) == np.uint32


def test_held_out_rule_needs_no_count_and_is_deterministic():
    docs = [f"document {i} " * (1 + i % 7) for i in range(20_000)]
    held = [d for d in docs if documents.is_held_out(d, 0.05)]
    assert 0.045 < len(held) / len(docs) < 0.055  # the fraction, on a stream of unknown length
    assert held == [d for d in docs if documents.is_held_out(d, 0.05)]  # the same split every time
    assert all(documents.is_held_out(d, 0.1) for d in held)  # a larger fraction only adds documents
    train, val = documents.split_by_position("line one\nline two\nline three\nline four\n", 0.25)
    assert train == "line one\nline two\nline three\n" and val == "line four\n"
    assert documents.split_by_position("no line end at all", 0.3) == ("no line end at all", "")


def test_windows_and_sample_order():
    tokens = np.arange(101)
    assert token_data.num_windows(101, 10) == 10
    assert token_data.window(tokens, 3, 10).tolist() == list(range(30, 41))  # seq_len + 1 tokens, overlapping by one
    n = 7
    epoch0 = [token_data.sample_window(5, i, n) for i in range(n)]
    epoch1 = [token_data.sample_window(5, i, n) for i in range(n, 2 * n)]
    assert sorted(w for _, w in epoch0) == list(range(n)) and sorted(w for _, w in epoch1) == list(range(n))
    assert {e for e, _ in epoch0} == {0} and {e for e, _ in epoch1} == {1}
    assert [w for _, w in epoch0] != [w for _, w in epoch1]
    assert token_data.sample_window(5, 9, n) == token_data.sample_window(5, 9, n)


def test_bpe_spec():
    assert prepare_data.parse_bpe_spec("bpe:8192") == 8192
    assert prepare_data.parse_bpe_spec("gpt2") is None
    for bad in ("bpe:abc", "bpe:", "bpe:10"):
        with pytest.raises(UserError, match="bpe:"):
            prepare_data.parse_bpe_spec(bad)


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"good \xff\xfe text \xef\xbf\xbd kept\n")  # two bad bytes and one real U+FFFD
    text, replaced = documents.read_text(f)
    assert replaced == 2 and text.count("\ufffd") == 3


# --- the reader refuses what disagrees with meta.json ---------------------------------------------------------------


def test_reader_checks_size_dtype_and_version(docs_data, tmp_path):
    meta = token_data.read_meta(docs_data)
    train = token_data.load_split(docs_data, "train", meta)
    assert len(train) == meta["splits"]["train"]["tokens"] and train.dtype == np.uint16
    bad = tmp_path / "bad"
    shutil.copytree(docs_data, bad)
    with open(bad / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="truncated or foreign"):
        token_data.load_split(bad, "train")
    for key, value, match in (("format_version", 99, "format version"), ("dtype", "uint32", "dtype")):
        m = json.loads((docs_data / "meta.json").read_text())
        m[key] = value
        (bad / "meta.json").write_text(json.dumps(m))
        with pytest.raises(UserError, match=match):
            token_data.read_meta(bad)
    with pytest.raises(UserError, match="no meta.json"):
        token_data.read_meta(tmp_path)


# --- real runs ----------------------------------------------------------------------------------------------------


def test_python_docs_needs_no_network_or_files(docs_data):
    meta = json.loads((docs_data / "meta.json").read_text())
    assert set(meta["splits"]) == {"train", "validation"}
    assert meta["sources"][0]["spec"] == "python-docs" and len(meta["sources"][0]["sha256"]) == 64
    assert meta["splits"]["train"]["bytes"] > 1_000_000  # ~1.9 MB of English on Python 3.11
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    tokens = token_data.load_split(docs_data, "train", meta)
    assert int((np.asarray(tokens) == meta["eos_id"]).sum()) == meta["splits"]["train"]["documents"]
    assert tokens[-1] == meta["eos_id"]
    held = [json.loads(line)["text"] for line in (docs_data / "validation.jsonl").read_text().splitlines()]
    assert len(held) == meta["splits"]["validation"]["documents"]
    assert sum(len(d.encode()) for d in held) == meta["splits"]["validation"]["bytes"]


@pytest.mark.slow
def test_second_identical_run_is_a_no_op(docs_data):
    before = (docs_data / "train.bin").stat().st_mtime_ns
    t0 = time.perf_counter()
    proc = run(PREPARE + docs_prepare_args(docs_data) + ["--overwrite"])
    assert "up to date" in proc.stdout  # --overwrite replaces only data prepared from other inputs
    assert (docs_data / "train.bin").stat().st_mtime_ns == before
    assert time.perf_counter() - t0 < 60  # seconds, not a re-tokenization (generous: a loaded CI machine)


@pytest.mark.slow
def test_other_inputs_need_overwrite(docs_data, tmp_path):
    proc = run(PREPARE + ["--dataset", "python-docs", "--tokenizer", "bpe:600", "--output_dir", docs_data], check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    copy = tmp_path / "copy"
    shutil.copytree(docs_data, copy)
    run(PREPARE + ["--dataset", "python-docs", "--tokenizer", "bpe:600", "--output_dir", copy, "--overwrite"])
    assert token_data.read_meta(copy)["vocab_size"] == 600 and not list(tmp_path.glob(".copy*"))


@needs_wikitext
@pytest.mark.slow
def test_wikitext2_round_trip_and_counts(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "wt2"
    run(PREPARE + ["--dataset", str(WIKITEXT2), "--tokenizer", "bpe:8192", "--output_dir", out])
    meta = token_data.read_meta(out)
    assert set(meta["splits"]) == {"train", "validation", "test"}
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    eos = meta["eos_id"]
    test_tokens = np.asarray(token_data.load_split(out, "test", meta))
    first_doc = test_tokens[: int(np.argmax(test_tokens == eos))].tolist()
    articles = {
        "test": documents.split_wikitext_articles((WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8")),
        "validation": documents.split_wikitext_articles((WIKITEXT2 / "wiki.valid.raw").read_text(encoding="utf-8")),
        "train": documents.split_wikitext_articles((WIKITEXT2 / "wiki.train.tokens").read_text(encoding="utf-8")),
    }
    assert tok.decode(first_doc) == articles["test"][0]
    assert articles["test"][0].startswith(" = Robert Boulter = \n")
    for split, docs in articles.items():
        expected = sum(len(ids) for ids in tok(docs, add_special_tokens=False)["input_ids"]) + len(docs)
        assert meta["splits"][split]["tokens"] == expected, split
        assert meta["splits"][split]["documents"] == len(docs)


class LocalHub(corpora.HubAccess):
    """The Hub's file listing and file reads served from a local directory laid out like the Hub, one folder per
    revision (ROOT/main/..., ROOT/refs/convert/parquet/...): everything of a Hub preset but the HTTP requests."""

    def __init__(self, root):
        self.root = root

    def list_files(self, repo, revision):
        base = self.root / revision
        if not base.is_dir():
            return None
        return f"sha-of-{revision}", sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())

    def open(self, repo, commit, path):
        return open(self.root / commit.removeprefix("sha-of-") / path, "rb")


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": rows}), path, row_group_size=7)


def test_openwebtext_preset_falls_back_to_the_hubs_parquet_conversion(tmp_path, monkeypatch, capsys):
    """Skylion007/openwebtext's main branch holds a loading script (refused by datasets >= 4): the preset reads the
    Hub's Parquet conversion instead, through the whole prepare_data.py pipeline, and records the commit it read."""
    (tmp_path / "hub" / "main").mkdir(parents=True)
    (tmp_path / "hub" / "main" / "openwebtext.py").write_text("# a loading script\n")
    docs = list(synthetic_web_documents(300_000, seed=1))
    write_parquet(tmp_path / "hub" / "refs/convert/parquet" / "plain_text/train/0000.parquet", docs[: len(docs) // 2])
    write_parquet(tmp_path / "hub" / "refs/convert/parquet" / "plain_text/train/0001.parquet", docs[len(docs) // 2 :])
    monkeypatch.setattr(corpora, "HubAccess", lambda: LocalHub(tmp_path / "hub"))
    monkeypatch.setattr(corpora, "hub_unreachable_reason", lambda: None)
    out = tmp_path / "owt"
    assert (
        prepare_data.main(
            [
                "--dataset",
                "openwebtext",
                "--tokenizer",
                "bpe:300",
                "--output_dir",
                str(out),
                "--num_proc",
                "1",
                "--validation_fraction",
                "0.05",
            ]
        )
        == 0
    )
    meta = token_data.read_meta(out)
    (source,) = meta["sources"]
    assert (source["revision"], source["commit"], source["files"]) == (
        "refs/convert/parquet",
        "sha-of-refs/convert/parquet",
        2,
    )
    assert sum(source["documents"].values()) == len(docs) and source["documents"]["validation"] > 0
    held = [json.loads(line)["text"] for line in (out / "validation.jsonl").read_text().splitlines()]
    assert held == [d for d in docs if documents.is_held_out(d, 0.05)]

    # only a partial conversion, and a script on main: one line that says what to download and how to pass it
    shutil.move(
        tmp_path / "hub" / "refs/convert/parquet" / "plain_text/train",
        tmp_path / "hub" / "refs/convert/parquet" / "plain_text/partial-train",
    )
    assert (
        prepare_data.main(["--dataset", "openwebtext", "--tokenizer", "bpe:300", "--output_dir", str(tmp_path / "o2")])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "partial" in err and "loading script" in err and "--dataset path/to/openwebtext" in err
    assert not (tmp_path / "o2").exists() and not (tmp_path / ".o2.partial").exists()


@needs_wikitext
def test_hub_wikitext_rows_give_the_documents_of_the_local_file(tmp_path):
    """Salesforce/wikitext stores a row per line with blank lines as empty strings: a Parquet fixture in that layout
    goes through the Hub preset's code and must give the local raw file's documents byte for byte."""
    raw = (WIKITEXT2 / "wiki.test.raw").read_text(encoding="utf-8")
    rows = [line + "\n" if line.strip() else "" for line in raw.split("\n")[:-1]]
    assert len(rows) == 4358  # the Hub's row count for this split
    write_parquet(tmp_path / "main" / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet", rows)
    write_parquet(tmp_path / "main" / "wikitext-103-raw-v1" / "test-00000-of-00001.parquet", ["not this subset\n"])
    hub = corpora.open_source("wikitext-2", hub=LocalHub(tmp_path))
    assert list(hub.splits) == ["test"] and hub.identity["revision"] == "main"
    local = corpora.open_source(str(WIKITEXT2 / "wiki.test.raw"))
    docs = list(hub.splits["test"]())
    assert docs == list(local.splits["train"]()) and len(docs) == 62


def test_layout_splits_reads_hub_and_local_layouts():
    assert corpora.layout_splits(["plain_text/train/0000.parquet", "plain_text/validation/0000.parquet"]) == {
        "train": ["plain_text/train/0000.parquet"],
        "validation": ["plain_text/validation/0000.parquet"],
    }
    assert corpora.layout_splits(
        ["w/test-00000-of-00001.parquet", "w/train-00000-of-00002.parquet", "w/valid.jsonl"]
    ) == {
        "test": ["w/test-00000-of-00001.parquet"],
        "train": ["w/train-00000-of-00002.parquet"],
        "validation": ["w/valid.jsonl"],
    }
    assert corpora.layout_splits(["a.txt", "notes/b.txt", "test_notes.txt"]) == {
        "train": ["a.txt", "notes/b.txt", "test_notes.txt"]
    }
    with pytest.raises(UserError, match="partial"):
        corpora.layout_splits(["plain_text/partial-train/0000.parquet"])


@pytest.mark.slow
def test_several_sources_jsonl_parquet_and_tolerated_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": f"record {i} " * 20}) + "\n" for i in range(60)))
    pq.write_table(pa.table({"body": [f"row {i} " * 20 for i in range(60)]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_bytes(b"\xef\xbb\xbf" + b"plain text with a bad byte \xff here\r\n" * 20)
    out = tmp_path / "out"
    proc = run(
        PREPARE
        + [
            "--dataset",
            str(tmp_path / "a.jsonl"),
            "--dataset",
            str(tmp_path / "b.parquet"),
            "--dataset",
            str(tmp_path / "c.txt"),
            "--text_field",
            "body",
            "--tokenizer",
            "bpe:300",
            "--output_dir",
            out,
            "--validation_fraction",
            "0.1",
        ]
    )
    meta = token_data.read_meta(out)
    assert [sum(s["documents"].values()) for s in meta["sources"]] == [60, 60, 2]  # c.txt: one document, cut in two
    c = meta["sources"][2]
    assert (c["replaced_bytes"], c["crlf_line_ends"], c["bom_files"]) == (20, 20, 1)
    assert "20 replaced bytes, 20 crlf line ends, 1 bom files" in proc.stderr
    held = [json.loads(line)["text"] for line in (out / "validation.jsonl").read_text().splitlines()]
    assert held[-1] == "plain text with a bad byte \ufffd here\n" * 2  # the file's last 10%, at a line end, LF only


@pytest.mark.slow
def test_one_big_text_file_with_a_document_separator(tmp_path):
    docs = list(synthetic_web_documents(200_000, seed=2))
    (tmp_path / "owt_sample.txt").write_text("\n\n\n".join(docs) + "\n")
    (tmp_path / "eot.txt").write_text("<|endoftext|>".join(docs))
    for name, separator in (("owt_sample.txt", "blank_line"), ("eot.txt", "<|endoftext|>")):
        out = tmp_path / f"out-{separator[:5]}"
        run(
            PREPARE
            + [
                "--dataset",
                str(tmp_path / name),
                "--doc_separator",
                separator,
                "--tokenizer",
                "bpe:300",
                "--output_dir",
                out,
                "--validation_fraction",
                "0.1",
            ]
        )
        meta = token_data.read_meta(out)
        expected = [p for d in docs for p in d.split("\n\n")] if separator == "blank_line" else docs
        assert sum(s["documents"] for s in meta["splits"].values()) == len(expected), separator


def web_corpus(path, n_bytes):
    path.write_text(
        "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in synthetic_web_documents(n_bytes))
    )
    return path


@pytest.mark.slow
def test_same_bytes_whatever_num_proc(docs_data, tmp_path):
    """Many batches per split (4 MB of text, batches of ~1 MB or 1000 documents), tokenized in this process or in
    two worker processes: the same bytes."""
    corpus = web_corpus(tmp_path / "web.jsonl", 4_000_000)
    outs = []
    for n in (1, 2):
        outs.append(tmp_path / f"np{n}")
        run(
            PREPARE
            + [
                "--dataset",
                corpus,
                "--tokenizer",
                docs_data / "tokenizer",
                "--output_dir",
                outs[-1],
                "--num_proc",
                str(n),
            ]
        )
    for name in ("train.bin", "validation.bin", "validation.jsonl", "tokenizer/tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    a, b = (json.loads((d / "meta.json").read_text()) for d in outs)
    assert {k: v for k, v in a.items() if k != "command"} == {k: v for k, v in b.items() if k != "command"}


@pytest.mark.slow
def test_killed_run_resumes_from_its_checkpoint_to_identical_bytes(docs_data, tmp_path):
    """SIGKILL mid-run (tokenizer processes too), run the same command again: it continues from the last checkpoint,
    and the directory it finishes is byte-identical to an uninterrupted run's."""
    import signal
    import subprocess

    corpus = web_corpus(tmp_path / "web.jsonl", 6_000_000)
    out = tmp_path / "out"
    cmd = PREPARE + [
        "--dataset",
        str(corpus),
        "--tokenizer",
        str(docs_data / "tokenizer"),
        "--output_dir",
        str(out),
        "--checkpoint_mb",
        "1",
        "--num_proc",
        "2",
    ]
    run(cmd)
    reference = tmp_path / "reference"
    out.rename(reference)

    partial = tmp_path / ".out.partial"

    def written_past_checkpoint() -> bool:  # train.bin holds tokens the last checkpoint does not cover
        progress = json.loads((partial / "progress.json").read_text())
        return (partial / "train.bin").stat().st_size > 2 * progress["splits"]["train"]["tokens"]  # uint16 ids

    for attempt in range(5):  # a checkpoint can land between seeing the extra tokens and the kill: then again
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                if written_past_checkpoint():
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, "finished before the kill: make the corpus larger"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if written_past_checkpoint():  # the rerun must cut those tokens off, not keep them
            break
    assert not out.exists() and written_past_checkpoint()
    done = json.loads((partial / "progress.json").read_text())["position"]["documents"]

    again = run(cmd)
    assert f"resuming {partial} from its last checkpoint" in again.stdout and f"{done:,} documents in" in again.stdout
    assert not partial.exists()
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    for name in files:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.slow
def test_overwrite_deletes_only_what_prepare_data_wrote(docs_data, tmp_path):
    project = tmp_path / "project"
    shutil.copytree(docs_data, project)
    (project / "notes.md").write_text("my notes")  # a user's file beside the prepared data
    (project / "src").mkdir()
    proc = run(
        PREPARE + ["--dataset", "python-docs", "--tokenizer", "bpe:512", "--output_dir", project, "--overwrite"],
        check=False,
    )
    assert proc.returncode == 2 and "notes.md, src" in proc.stderr and "nothing was deleted" in proc.stderr
    assert (project / "notes.md").read_text() == "my notes" and (project / "train.bin").is_file()
    home = tmp_path / "home"
    home.mkdir()
    (home / "meta.json").write_text('{"name": "some other tool"}')
    proc = run(PREPARE + ["--dataset", "python-docs", "--output_dir", home, "--overwrite"], check=False)
    assert proc.returncode == 2 and "no meta.json of prepare_data.py" in proc.stderr
    assert (home / "meta.json").read_text() == '{"name": "some other tool"}'


# --- bad input: one-line error, exit 2, nothing written ---------------------------------------------------------------


def bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"content": "x"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": "fine"}\n{"text": 42}\n')
    (tmp_path / "utf16.txt").write_text("some text\n" * 50, encoding="utf-16")
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    (wiki / "wiki.train.raw").write_text(WIKI * 5)
    (wiki / "wiki.valid.raw").write_text(" \n")
    return {
        "missing path": (["--dataset", str(tmp_path / "nope.txt")], "neither an existing file"),
        "empty file": (["--dataset", str(tmp_path / "empty.txt")], "empty.txt is empty"),
        "whitespace-only split": (["--dataset", str(wiki)], "wiki.valid.raw is empty (whitespace only)"),
        "no text field": (["--dataset", str(tmp_path / "nofield.jsonl")], "nofield.jsonl:2 has no 'text' field"),
        "non-string text": (["--dataset", str(tmp_path / "number.jsonl")], "number.jsonl:2: 'text' holds a int"),
        "utf-16": (["--dataset", str(tmp_path / "utf16.txt")], "utf16.txt is UTF-16"),
        "empty validation": (
            ["--dataset", str(tmp_path / "few.jsonl"), "--validation_fraction", "0.01"],
            "none of its 3 documents fell in the validation split",
        ),
        "unknown preset": (["--dataset", "wikitext-5"], "known preset"),
        "bpe not a number": (["--dataset", "python-docs", "--tokenizer", "bpe:lots"], "bpe: takes a vocabulary size"),
        "hub offline": (["--dataset", "wikitext-103"], "local copy"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "empty file",
        "whitespace-only split",
        "no text field",
        "non-string text",
        "utf-16",
        "empty validation",
        "unknown preset",
        "bpe not a number",
        "hub offline",
    ],
)
@pytest.mark.slow
def test_bad_input_fails_cleanly(tmp_path, case):
    args, message = bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    t0 = time.perf_counter()
    # HF_ENDPOINT at a closed local port: "offline" on any machine, and it must fail fast, not retry for minutes.
    proc = run(
        PREPARE + args + ["--output_dir", out, "--tokenizer", "bpe:300"]
        if "--tokenizer" not in args
        else PREPARE + args + ["--output_dir", out],
        check=False,
        env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output dir, no partial dir
    assert time.perf_counter() - t0 < 60


def test_bpe_trains_from_a_stream_of_documents():
    tok = prepare_data.load_tokenizer("bpe:300", iter(["hello world " * 50, "another document " * 40] * 10))
    assert tok.eos_token == prepare_data.BPE_EOS and tok.bos_token_id == tok.eos_token_id
    text = "hello world, another document!\n  spaced"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: exact round trip


# --- special tokens' text inside documents (issue #59) ---------------------------------------------------------------


SPECIAL_TEXT_DOCS = [
    "GPT-2 ends each document with <|endoftext|> when it packs text; a tokenizer must not cut here.",
    "An ordinary document about language models, with no special text in it at all.",
    "Twice: <|endoftext|><|endoftext|> and the end of the sentence.",
]


@pytest.mark.parametrize("tokenizer", ["bpe:300", "a tokenizer directory"])
def test_special_token_text_in_a_document_is_text(tokenizer, docs_data, tmp_path):
    """A literal `<|endoftext|>` in a document's text became the end-of-document id, so document masking cut the
    document there: for a BPE trained here and for a tokenizer loaded by AutoTokenizer (a Hub id or, here, a directory)
    alike. Now the text is tokenized as text, and the EOS ids in the token files are exactly one per document."""
    source = tmp_path / "lm.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in SPECIAL_TEXT_DOCS * 40))
    spec = str(docs_data / "tokenizer") if tokenizer != "bpe:300" else tokenizer
    out = tmp_path / "data"
    assert prepare_data.main(["--dataset", str(source), "--tokenizer", spec, "--output_dir", str(out), "--num_proc",
                              "1", "--validation_fraction", "0.2"]) == 0  # fmt: skip
    meta = token_data.read_meta(out)
    for split in ("train", "validation"):
        tokens = np.asarray(token_data.load_split(out, split, meta))
        assert int((tokens == meta["eos_id"]).sum()) == meta["splits"][split]["documents"], split
    assert meta["special_tokens_in_documents"] == "text"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    tokens = np.asarray(token_data.load_split(out, "train", meta))
    first = tokens[: int(np.argmax(tokens == meta["eos_id"]))]
    assert tok.decode(first) in SPECIAL_TEXT_DOCS  # the document whole, its special text included


@pytest.mark.slow
def test_data_prepared_before_special_token_text_was_text_is_rebuilt_not_kept(docs_data, tmp_path):
    """Data prepared before the fix (meta.json without special_tokens_in_documents) may hold documents cut at such
    text: the same command no longer calls it up to date, and says why."""
    copy = tmp_path / "python-docs"
    shutil.copytree(docs_data, copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["special_tokens_in_documents"]
    meta["fingerprint"] = "0" * 64  # what the fingerprint of the same inputs was, without the setting
    (copy / "meta.json").write_text(json.dumps(meta))
    proc = run(PREPARE + docs_prepare_args(copy), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "was prepared before special tokens' text in documents was tokenized as text" in errors[0], errors
    assert "--overwrite" in errors[0]
