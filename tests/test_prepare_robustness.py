"""prepare_data.py against damaged state, foreign files and odd inputs (issue #20): it never reads its own output as a
corpus, never hangs on a dead tokenizer process, tokenizes long documents in bounded memory to the same ids, works
offline and behind a proxy, and refuses a damaged file in one line or works around it."""

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from common import synthetic_web_documents
from conftest import REPO, WIKITEXT2, run

import prepare_data
from deepseek_zero3.prepare import corpora, documents, tokenizer_pool
from deepseek_zero3.training_data import token_data

PREPARE = [sys.executable, "prepare_data.py"]


def jsonl_corpus(path, n_bytes, seed=0):
    docs = list(synthetic_web_documents(n_bytes, seed=seed))
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs))
    return path


def prepare(args, capsys) -> tuple[int, str, str]:
    """prepare_data.py in this process (no interpreter start): its exit status, stdout and stderr."""
    status = prepare_data.main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def snapshot(root) -> dict:
    """Every file under root with its bytes: what a refused run must leave as it was."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- item 2: a source directory or glob never reads prepare_data.py's own outputs ------------------------------------


def test_sources_leave_out_prepare_datas_own_outputs(tmp_path, capsys):
    """--output_dir inside the --dataset directory: the rerun must not read validation.jsonl (nor a killed run's
    .NAME.partial) as corpus text, so it is up to date; a glob leaves them out too; the output itself is no corpus."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    jsonl_corpus(corpus / "web.jsonl", 150_000)
    args = ["--dataset", corpus, "--tokenizer", "bpe:300", "--num_proc", "1", "--validation_fraction", "0.1"]
    assert prepare(args + ["--output_dir", corpus / "data"], capsys)[0] == 0
    first = token_data.read_meta(corpus / "data")
    killed = corpus / ".old.partial"  # what a killed run leaves: its held-out text and its progress
    killed.mkdir()
    (killed / "validation.jsonl").write_bytes((corpus / "data" / "validation.jsonl").read_bytes())
    (killed / "progress.json").write_text("{}")

    status, out, _ = prepare(args + ["--output_dir", corpus / "data", "--overwrite"], capsys)
    assert status == 0 and "is up to date" in out, out
    assert f"left out {killed}, {corpus / 'data'}" in out and out.count("left out") == 1

    glob_args = ["--dataset", f"{tmp_path}/**/*.jsonl"] + args[2:] + ["--output_dir", corpus / "again"]
    status, out, _ = prepare(glob_args, capsys)
    assert status == 0 and "left out" in out
    assert token_data.read_meta(corpus / "again")["splits"] == first["splits"]  # the same documents, once each

    status, _, err = prepare(["--dataset", corpus / "data"] + args[2:] + ["--output_dir", tmp_path / "x"], capsys)
    assert status == 2 and "an output (or work directory) of prepare_data.py, not a corpus" in err


# --- item 5: a dead tokenizer process stops the run at once, resumably -----------------------------------------------


@pytest.mark.slow
def test_dead_tokenizer_process_stops_the_run_and_a_rerun_resumes(docs_data, tmp_path):
    """kill -9 of one of two tokenizer processes (what the out-of-memory killer does): the run ends within seconds with
    exit status 3 and one error line naming the process and the signal, the other process stopped, the partial output
    kept; the same command again resumes it to the bytes of an uninterrupted run."""
    import psutil

    corpus = jsonl_corpus(tmp_path / "web.jsonl", 4_000_000)
    cmd = PREPARE + ["--dataset", corpus, "--tokenizer", docs_data / "tokenizer", "--checkpoint_mb", "1"]
    out, reference, partial = tmp_path / "out", tmp_path / "reference", tmp_path / ".out.partial"
    run(cmd + ["--output_dir", reference, "--num_proc", "1"])  # the same bytes for any --num_proc

    cmd = [str(a) for a in cmd + ["--output_dir", out, "--num_proc", "2"]]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    main, deadline, workers = psutil.Process(proc.pid), time.time() + 120, []
    while time.time() < deadline and proc.poll() is None:
        workers = [p for p in main.children() if "spawn_main" in " ".join(p.cmdline())]
        if len(workers) == 2 and (partial / "progress.json").is_file():
            break
        time.sleep(0.02)
    assert proc.poll() is None and len(workers) == 2, "finished before the kill: make the corpus larger"
    os.kill(workers[0].pid, signal.SIGKILL)
    t0 = time.time()
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("prepare_data.py still waits 30 s after its tokenizer process died")
    assert time.time() - t0 < 15 and proc.returncode == 3, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert f"tokenizer process {workers[0].pid} was killed by SIGKILL" in errors[0]
    assert f"partial output stays in {partial}: run the same command again" in errors[0]
    assert not workers[1].is_running() or workers[1].status() == psutil.STATUS_ZOMBIE
    assert (partial / "progress.json").is_file() and not out.exists()

    again = run(cmd)
    assert f"resuming {partial}" in again.stdout and not partial.exists()
    for name in ("train.bin", "validation.bin", "validation.jsonl", "tokenizer/tokenizer.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_a_process_killed_halfway_through_a_result_is_named_not_waited_on(docs_data, monkeypatch):
    """Each tokenizer process writes half of a result's message and is killed: the pool names it within seconds.
    concurrent.futures' pool, which this replaced, waited forever for the rest of such a message (the test above hung
    so about once in eight runs on a loaded machine)."""
    monkeypatch.setenv("TOKENIZER_TEST_FAULT", "die_sending")
    pool = tokenizer_pool.TokenizerPool(2, (str(docs_data / "tokenizer"), "<u2", 0, False))
    try:
        first = pool.submit(tokenizer_pool.Task("train", ["some text"]))
        pool.submit(tokenizer_pool.Task("train", ["more text"]))
        raised = []
        wait = lambda: raised.append(pytest.raises(Exception, pool.result, first))  # noqa: E731
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the pool still waits 30 s after its process died"
        assert raised[0].type is tokenizer_pool.WorkerDied
        assert re.fullmatch(r"tokenizer process \d+ was killed by SIGKILL .*", str(raised[0].value)), raised[0].value
        assert all(process.exitcode is not None for process in pool.processes)
    finally:
        pool.stop()


@pytest.mark.parametrize("tokenizer_json, why", [('{"version": "1.0", "model": ', "EOF while"), (None, "ValueError")])
@pytest.mark.slow
def test_a_tokenizer_that_no_process_can_load_is_one_message_not_tracebacks(tmp_path, capfd, tokenizer_json, why):
    """Each tokenizer process loads the tokenizer the main process saved; when that fails there (a tokenizer.json cut
    off; none, where AutoTokenizer's error spans lines), the pool says why once, on one line (the main process prints
    it as the one error: line), instead of each process printing its traceback."""
    if tokenizer_json is not None:
        (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    pool = tokenizer_pool.TokenizerPool(2, (str(tmp_path), "<u2", 0, False))
    try:
        said = rf"tokenizer process \d+ could not load the tokenizer saved in {re.escape(str(tmp_path))} \(.*{why}"
        with pytest.raises(tokenizer_pool.WorkerDied, match=said) as raised:
            pool.result(pool.submit(tokenizer_pool.Task("train", ["some text"])))
        assert "\n" not in str(raised.value)
        assert all(process.exitcode is not None for process in pool.processes)
    finally:
        pool.stop()
    assert "Traceback" not in capfd.readouterr().err


# --- item 6: long documents in bounded pieces, the same ids as whole --------------------------------------------------


def deepseek_like_tokenizer(directory, kind: str, docs: list[str]):
    """A BPE trained here behind DeepSeek's kinds of pre-tokenizer (as llama.cpp transcribes them): "llm" is DeepSeek
    LLM's sequence of Split regexes (its letter class cut down to Latin, Greek, Cyrillic and Armenian), "v3" is
    DeepSeek-V3's; "no_regex" is a byte-level BPE without its regex, which no cut can be safe for."""
    from tokenizers import Regex, Tokenizer, models, trainers
    from tokenizers import pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    stages = {
        "llm": [
            pt.Split(Regex("[\r\n]"), "isolated"),
            pt.Split(Regex("\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-Ֆ]+"), "isolated"),
            pt.Split(Regex("\\s?[!-/:-~！-／：-～‘-‟　-。]+"), "isolated"),
            pt.Split(Regex("\\s+$"), "isolated"),
            pt.Split(Regex("[一-龥ࠀ-一가-퟿]+"), "isolated"),
            pt.Digits(individual_digits=True),
            byte_level,
        ],
        "v3": [
            pt.Split(Regex("\\p{N}{1,3}"), "isolated"),
            pt.Split(Regex("[一-龥぀-ゟ゠-ヿ]+"), "isolated"),
            pt.Split(
                Regex(
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
                    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
                ),
                "isolated",
            ),
            byte_level,
        ],
        "no_regex": [byte_level],
    }[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pt.Sequence(stages)
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs, trainer=trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


ADVERSARIAL = "".join(
    f"{w}{sep}"
    for w in ["word", "don't", "é", "a\u0301", "中文", "😀", "x.", "42", "Ω", "\u200b"]
    for sep in [
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\n\n\n",
        "\r\n",
        "\r\n\r\n",
        " \n ",
        "\t",
        "\u00a0",
        "\u3000",
        " \r\n  ",
    ]
)


@pytest.fixture(scope="module")
def python_docs() -> list[str]:
    return corpora.python_docs_corpus()


@pytest.fixture(scope="module")
def cut_tokenizers(docs_data, python_docs, tmp_path_factory) -> dict:
    docs = python_docs[:150]
    root = tmp_path_factory.mktemp("tokenizers")
    made = {kind: deepseek_like_tokenizer(root / kind, kind, docs) for kind in ("llm", "v3", "no_regex")}
    return {"bpe": docs_data / "tokenizer", **made}


@pytest.mark.parametrize("kind", ["bpe", "llm", "v3"])
@pytest.mark.slow
def test_long_documents_in_pieces_give_the_whole_documents_ids(cut_tokenizers, python_docs, kind):
    """Real text (python-docs; WikiText-2 validation when present) and adversarial runs of newlines, spaces, CRLF and
    non-ASCII, cut into pieces at every cut PIECE_CUT allows past 200 characters (past 1 character for the adversarial
    text): the concatenated ids of the pieces are the whole text's."""
    from tokenizers import Tokenizer

    assert tokenizer_pool.cut_problem(cut_tokenizers[kind]) is None
    tok = Tokenizer.from_file(str(cut_tokenizers[kind] / "tokenizer.json"))
    texts = {"python-docs": "\n\n".join(python_docs)[-400_000:], "adversarial": ADVERSARIAL * 10}
    if (WIKITEXT2 / "wiki.valid.raw").is_file():
        texts["wikitext-2"] = (WIKITEXT2 / "wiki.valid.raw").read_text(encoding="utf-8")[:400_000]
    for name, text in texts.items():
        size = 1 if name == "adversarial" else 200
        pieces = list(tokenizer_pool.document_pieces(text, size, tokenizer_pool.PIECE_CUT))
        assert "".join(pieces) == text and len(pieces) > len(text) // 2000, name
        whole = tok.encode(text, add_special_tokens=False).ids
        cut = [t for e in tok.encode_batch(pieces, add_special_tokens=False) for t in e.ids]
        assert cut == whole, name


def test_tokenizers_that_cannot_be_cut_are_tokenized_whole(cut_tokenizers, python_docs, tmp_path):
    from tokenizers import Tokenizer

    no_regex = cut_tokenizers["no_regex"]
    assert "probe" in tokenizer_pool.cut_problem(no_regex)  # and rightly: cutting changes its ids
    tok = Tokenizer.from_file(str(no_regex / "tokenizer.json"))
    text = "\n\n".join(python_docs[:50])
    pieces = list(tokenizer_pool.document_pieces(text, 200, tokenizer_pool.PIECE_CUT))
    assert [t for e in tok.encode_batch(pieces) for t in e.ids] != tok.encode(text).ids
    metaspace = json.loads((cut_tokenizers["bpe"] / "tokenizer.json").read_text())
    metaspace["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(metaspace))
    assert "Metaspace" in tokenizer_pool.cut_problem(tmp_path)
    assert list(tokenizer_pool.document_pieces(text, 200, None)) == [text]


@pytest.mark.slow
def test_one_long_document_tokenizes_in_bounded_memory_to_the_same_ids(docs_data, tmp_path, monkeypatch, capsys):
    """One 3 MB text file is one document (--doc_separator file). Its tokenizer processes stay small (whole, the
    document took ~100-180x its size), its ids are those of the whole text, and streamed from disk (a file over
    LONG_DOCUMENT_BYTES, lowered here) it gives the same bytes."""
    from tokenizers import Tokenizer

    text = "\n\n".join(synthetic_web_documents(3_000_000, seed=4)) + "\n"
    (tmp_path / "one.txt").write_text(text)
    args = ["--dataset", tmp_path / "one.txt", "--tokenizer", docs_data / "tokenizer"]
    proc = run(PREPARE + args + ["--output_dir", tmp_path / "out", "--num_proc", "2"])
    worker_mib = float(proc.stdout.split(" MiB per tokenizer process")[0].rsplit("+ ", 1)[1].replace(",", ""))
    assert worker_mib < 300, proc.stdout  # ~450 MiB whole; ~120 MiB in pieces

    monkeypatch.setattr(documents, "LONG_DOCUMENT_BYTES", 1 << 20)
    assert prepare(args + ["--output_dir", tmp_path / "streamed", "--num_proc", "1"], capsys)[0] == 0
    for name in ("train.bin", "validation.bin", "validation.jsonl"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name

    tok = Tokenizer.from_file(str(docs_data / "tokenizer" / "tokenizer.json"))
    meta = token_data.read_meta(tmp_path / "out")
    train, held = documents.split_by_position(text, prepare_data.Config.validation_fraction)
    for split, part in (("train", train), ("validation", held)):
        ids = np.asarray(token_data.load_split(tmp_path / "out", split, meta))
        assert ids.tolist() == tok.encode(part, add_special_tokens=False).ids + [meta["eos_id"]], split
    held_text = json.loads((tmp_path / "out" / "validation.jsonl").read_text())["text"]
    assert held_text == held


# --- item 20: offline and behind a proxy -----------------------------------------------------------------------------


@pytest.mark.slow
def test_offline_hub_tokenizer_is_identified_by_its_cached_commit(docs_data, tmp_path):
    """HF_HUB_OFFLINE=1 and a Hub tokenizer in the local cache: meta.json records the commit the cache holds (not
    "unknown"), so that the data stays up to date against an online run of the same commit; and with the commit out of
    reach altogether (cache gone), an up-to-date directory is still recognised, not rebuilt or called foreign."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--some-tokenizer"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(docs_data / "tokenizer", repo / "snapshots" / commit)
    (repo / "snapshots" / commit / "config.json").write_text('{"model_type": "llama"}')
    corpus = jsonl_corpus(tmp_path / "web.jsonl", 100_000)
    cmd = PREPARE + ["--dataset", corpus, "--tokenizer", "some-org/some-tokenizer", "--output_dir", tmp_path / "out"]
    cmd += ["--num_proc", "1", "--validation_fraction", "0.2"]
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home")}
    run(cmd, env=env)
    identity = token_data.read_meta(tmp_path / "out")["tokenizer_identity"]
    assert identity == {"spec": "some-org/some-tokenizer", "revision": commit}

    shutil.rmtree(tmp_path / "hub")
    proc = run(cmd, env=env)
    assert "is up to date" in proc.stdout and f"records, {commit}" in proc.stdout, proc.stdout


def test_hub_reachability_goes_through_the_proxy():
    """A cluster that reaches the Hub only through HTTP(S)_PROXY is online: the check asks through huggingface_hub's
    own client (a raw socket to an endpoint that only the proxy can resolve called it unreachable)."""
    seen = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proxy = f"http://127.0.0.1:{server.server_port}"
        env = {"HF_ENDPOINT": "http://hub.invalid", "HTTP_PROXY": proxy, "NO_PROXY": "", "no_proxy": ""}
        script = "from deepseek_zero3.prepare import corpora; print(corpora.hub_unreachable_reason())"
        proc = run([sys.executable, "-c", script], env={**env, "HF_HUB_OFFLINE": "0"})
        assert proc.stdout.strip() == "None" and seen == ["http://hub.invalid/"], (proc.stdout, seen)
        proc = run([sys.executable, "-c", script], env={**env, "HF_HUB_OFFLINE": "0", "HTTP_PROXY": ""})
        assert proc.stdout.startswith("cannot reach http://hub.invalid")  # without the proxy: unreachable, in words
    finally:
        server.shutdown()


# --- the class: every file prepare_data.py reads can be damaged ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small corpus and its prepared directory: the source of damaged copies."""
    root = tmp_path_factory.mktemp("tiny")
    jsonl_corpus(root / "web.jsonl", 120_000)
    run(PREPARE + ["--dataset", root / "web.jsonl", "--tokenizer", "bpe:300", "--output_dir", root / "ref"])
    return root


def damage(case: str, tmp_path, ref) -> tuple[list[str], str]:
    """Lay out one damaged input in tmp_path: (extra arguments, what the one error line says; "" when the run must work
    around the damage and give the reference output)."""
    import shutil

    def partial(progress: str, tokenizer_text: str | None = None):
        part = tmp_path / ".out.partial"
        shutil.copytree(ref / "tokenizer", part / "tokenizer")
        shutil.copy(ref / "train.bin", part / "train.bin")
        fp = json.loads((ref / "meta.json").read_text())["fingerprint"]
        (part / "progress.json").write_text(progress.replace("FP", fp))
        if tokenizer_text is not None:
            (part / "tokenizer" / "tokenizer.json").write_text(tokenizer_text)

    def output(edit):
        shutil.copytree(ref, tmp_path / "out")
        meta = (tmp_path / "out" / "meta.json").read_text()
        (tmp_path / "out" / "meta.json").write_text(edit(meta))

    parquet = tmp_path / "web.parquet"
    if case in ("truncated parquet", "empty parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [f"row {i} " * 30 for i in range(200)]}), parquet)
        data = parquet.read_bytes()
        parquet.write_bytes(data[: len(data) // 2] if case == "truncated parquet" else b"")
        return ["--dataset", str(parquet)], "web.parquet cannot be read as Parquet"
    if case == "binary file":
        (tmp_path / "blob.txt").write_bytes(np.random.default_rng(0).bytes(20_000))  # e.g. a compressed file
        return ["--dataset", str(tmp_path / "blob.txt")], "blob.txt is not UTF-8 text"
    if case == "torn output meta.json":
        output(lambda m: m[: len(m) // 2])
        return ["--overwrite"], "its meta.json is not valid JSON"
    if case == "output meta.json without splits":
        output(lambda m: json.dumps({k: v for k, v in json.loads(m).items() if k != "splits"}))
        return [], "holds damaged prepared data; pass --overwrite"
    if case == "output meta.json without splits, --overwrite":
        output(lambda m: json.dumps({k: v for k, v in json.loads(m).items() if k != "splits"}))
        return ["--overwrite"], ""
    if case == "partial is a file":
        (tmp_path / ".out.partial").write_text("mine")
        return [], ".out.partial is a file"
    position = '"position": {"source": 0, "documents": 20}'
    splits = '"splits": {"train": {"documents": 20, "tokens": TOKENS, "bytes": 1, "jsonl_bytes": 0}}'
    progress = f'{{"fingerprint": "FP", {position}, {splits}, "sources": [{{}}]}}'
    if case == "torn progress.json":
        partial(progress[:40])
    elif case == "progress.json not an object":
        partial("[]")
    elif case == "progress.json without a position":
        partial('{"fingerprint": "FP"}')
    elif case == "partial with a torn tokenizer":
        partial(progress.replace("TOKENS", "100"), (ref / "tokenizer" / "tokenizer.json").read_text()[:300])
    elif case == "partial train.bin shorter than its checkpoint":
        partial(progress.replace("TOKENS", str(10**7)))
    return [], ""


DAMAGE = [
    "truncated parquet",
    "empty parquet",
    "binary file",
    "torn output meta.json",
    "output meta.json without splits",
    "output meta.json without splits, --overwrite",
    "partial is a file",
    "torn progress.json",
    "progress.json not an object",
    "progress.json without a position",
    "partial with a torn tokenizer",
    "partial train.bin shorter than its checkpoint",
]


@pytest.mark.parametrize("case", DAMAGE)
@pytest.mark.slow
def test_damaged_input_is_refused_in_one_line_or_worked_around(tiny, tmp_path, case, capsys):
    """Each damaged file either stops the run with one `error:` line naming it and the fix (exit 2, no traceback,
    nothing changed), or the run works around it (a damaged partial output is its own to start afresh) and gives the
    reference output."""
    args, message = damage(case, tmp_path, tiny / "ref")
    if "--dataset" not in args:
        args += ["--dataset", str(tiny / "web.jsonl")]
    before = snapshot(tmp_path)
    status, _, err = prepare(args + ["--tokenizer", "bpe:300", "--output_dir", tmp_path / "out"], capsys)
    if message:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and message in errors[0], err
        assert snapshot(tmp_path) == before
    else:
        assert status == 0, err
        for name in ("train.bin", "validation.bin", "validation.jsonl", "tokenizer/tokenizer.json"):
            assert (tmp_path / "out" / name).read_bytes() == (tiny / "ref" / name).read_bytes(), name


# --- issue #35: what can be decided before tokenizing is -------------------------------------------------------------


def test_a_small_source_that_would_be_refused_is_refused_before_anything_is_tokenized(tmp_path, capsys):
    """A 20-document source of which none falls in the validation split (two times in three at the default fraction),
    or one holding only blank lines, listed after a larger one: refused in one line before the larger one is
    tokenized (it used to be refused at its own end, and the partial output deleted); the tokenizer is not trained,
    no checkpoint is written, nothing is left behind."""
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(synthetic_web_documents(1_500_000, seed=1)))
    for seed in range(100):  # the first 20-document text none of whose documents is held out
        twenty = tmp_path / "twenty.txt"
        twenty.write_text("\n\n".join(list(synthetic_web_documents(20_000, seed=seed))[:20]))
        source = corpora.open_source(str(twenty), separator="blank_line")
        if not any(split == "validation" for _, split in corpora.routed_documents(source, 0.02)):
            break
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    for second, message in ((twenty, "documents fell in the validation split at"), (empty, "is empty")):
        out = tmp_path / "out"
        status, stdout, stderr = prepare(
            ["--dataset", big, "--dataset", second, "--doc_separator", "blank_line", "--tokenizer", "bpe:300",
             "--checkpoint_mb", "1", "--num_proc", "1", "--output_dir", out], capsys
        )  # fmt: skip
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and str(second) in errors[0] and message in errors[0], stderr
        assert "checkpoint:" not in stdout + stderr and "tokens written" not in stdout + stderr, stdout
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "empty.txt", "twenty.txt"]


def test_a_read_only_output_directory_is_refused_before_any_input_is_read(tmp_path, capsys):
    """Issue #35: --output_dir on a read-only filesystem (a tmpfs mounted read-only; root ignores permission bits):
    exit 2 in one line, before the inputs are hashed, not an OSError once tokenizing has begun."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (not root, or no mount permission)")
    try:
        status, stdout, stderr = prepare(["--dataset", "python-docs", "--output_dir", ro / "data"], capsys)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert status == 2, stderr
    assert stderr.strip() == f"error: --output_dir {ro / 'data'}: cannot write in {ro} (Read-only file system); " \
                             "choose a writable one"  # fmt: skip


def test_an_output_name_its_work_directory_cannot_have_is_refused_before_any_input_is_read(tmp_path, capsys):
    """Issue #59, case 3: a 250-byte --output_dir name fits the filesystem, but its work directory .NAME.partial (259
    bytes) does not: refused in one line naming the limit, nothing written (it used to fail on .NAME.partial, advising
    to free space)."""
    (tmp_path / "in.txt").write_text("Some text.\n\nMore text.\n")
    status, _, stderr = prepare(["--dataset", tmp_path / "in.txt", "--output_dir", tmp_path / ("o" * 250)], capsys)
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert "also writes .NAME.partial beside it, a name of 259 bytes, over the 255 bytes" in stderr, stderr
    assert "choose a name of at most 246 bytes" in stderr and "free space" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_corpus_file_whose_name_is_not_utf8_is_named(tmp_path, capsys):
    """A file whose name is not UTF-8 inside a --dataset directory (a source is named after its file, and meta.json and
    the tokenizer take UTF-8 only): one line naming it, escaped, before anything is written (it used to end in a
    UnicodeEncodeError traceback while the inputs were hashed)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "fine.txt").write_text("Some text.\n\nMore text.\n")
    (Path(os.fsdecode(bytes(corpus) + b"/caf\xe9.txt"))).write_text("Latin-1 named.\n")
    status, _, stderr = prepare(["--dataset", corpus, "--output_dir", tmp_path / "out"], capsys)
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert rf"the name of {corpus}/caf\udce9.txt is not valid UTF-8" in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
