"""Seeded mutations of what a user hands the commands: every example spec (to `validate` and
`render`), a Hugging Face config.json under `model.init_from` (to `validate`), JSON lines (to
`data prepare`) and every kind of tokenizer file `data prepare` reads. Each outcome must be
exit 0 or 2 with no traceback, no code run from the input, and nothing half-written. The seeds
are fixed, so a failure reproduces; the counts are bounded so the whole file runs in seconds."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ctxlaunch.cli import app
from tests.helpers.paths import ROOT

SPEC_MUTATIONS = 24
"""Mutations of each example spec."""
CONFIG_MUTATIONS = 60
DATA_MUTATIONS = 60
TOKENIZER_MUTATIONS = 40
"""Mutations of each tokenizer kind's file."""

HOSTILE_SCALARS = [
    "null",
    "~",
    "-1",
    "0",
    "1e309",
    "[]",
    "{{}}",
    "true",
    "2024-01-01",
    "'x\\n'",
    '"a\\nb"',
    '"\\ud800"',
    '"\\0"',
    "9" * 40,
    "x" * 5000,
    "&anchor [*anchor, *anchor]",
    "*undefined",
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!binary AAAA",
    "{{a: [[[[[[[[[[]]]]]]]]]]}}",
]
"""Values a careless or hostile user puts where a spec's scalar was ({marker} is a file that
must never appear: the loader must not run code a tag names)."""
HOSTILE_CHARACTERS = ["\n", "\t", "\x00", ":", "{", "[", "'", '"', "&", "*", "!", "%", "#", "é"]


def _mutate_yaml(text: str, rng: random.Random, marker: Path) -> str:
    """One seeded mutation of a YAML document: a line removed, repeated or re-indented, a value
    replaced, a character inserted, or the text cut short."""
    lines = text.splitlines()
    operation = rng.randrange(6)
    where = rng.randrange(len(lines))
    if operation == 0:
        del lines[where]
    elif operation == 1:
        lines.insert(where, lines[where])
    elif operation == 2:
        lines[where] = lines[where][2:] if lines[where].startswith("  ") else "  " + lines[where]
    elif operation == 3:
        valued = [i for i, line in enumerate(lines) if ": " in line and not line.endswith(":")]
        if valued:
            where = rng.choice(valued)
        key = lines[where].split(": ", 1)[0]
        lines[where] = f"{key}: {rng.choice(HOSTILE_SCALARS).format(marker=marker)}"
    elif operation == 4:
        cut = rng.randrange(len(text))
        return text[:cut] + rng.choice(HOSTILE_CHARACTERS) + text[cut:]
    else:
        return text[: rng.randrange(len(text))]
    return "\n".join(lines) + "\n"


def _invoke(args: list[str]) -> int:
    """The command in process: its exit code, after checking it raised nothing but an exit
    and printed no traceback."""
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args,
        result.output,
        result.exception,
    )
    assert "Traceback" not in result.output, (args, result.output)
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output)
    return result.exit_code


EXAMPLES = sorted((ROOT / "jobs").glob("*.yaml")) + sorted((ROOT / "jobs" / "walk").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_mutated_example_specs_validate_and_render_or_exit_2(example: Path, tmp_path: Path) -> None:
    """Every mutation of the example gets exit 0 or 2 from `validate` and from `render -o`;
    `render` leaves either the whole artifact or nothing; no tag in the YAML runs code."""
    rng = random.Random(example.name)
    marker = tmp_path / "code-ran"
    text = example.read_text(encoding="utf-8")
    outcomes: Counter[int] = Counter()
    for number in range(SPEC_MUTATIONS):
        spec = tmp_path / f"m{number}.yaml"
        spec.write_bytes(_mutate_yaml(text, rng, marker).encode("utf-8", "surrogatepass"))
        code = _invoke(["validate", str(spec)])
        outcomes[code] += 1
        if code == 0:
            rendered = tmp_path / "out" / f"m{number}"
            _invoke(["render", str(spec), "-o", str(rendered)])
        assert not marker.exists(), f"{spec}: the YAML ran a command"
    leftovers = (
        [p.name for p in (tmp_path / "out").glob(".*")] if (tmp_path / "out").exists() else []
    )
    assert leftovers == []
    # The mutations reach both outcomes: a fuzz test whose inputs all fail (or all pass)
    # exercises one path only.
    assert outcomes[2] > 0 and sum(outcomes.values()) == SPEC_MUTATIONS


def _llama_config() -> dict[str, Any]:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    )
    return config.to_dict()


HOSTILE_JSON_VALUES: list[Any] = [
    None,
    "32",
    "",
    [1],
    {},
    -1,
    0,
    1e308,
    True,
    "\ud800",
    [[[[[[[[[[[[]]]]]]]]]]]],
    "x" * 10_000,
]


def test_mutated_config_json_validates_or_exits_2(tmp_path: Path) -> None:
    """config.json with a key removed, a value replaced by a hostile one (also inside
    rope_scaling), or its text cut short: `validate` exits 0 or 2, never a traceback."""
    rng = random.Random(7)
    base = _llama_config()
    outcomes: Counter[int] = Counter()
    for number in range(CONFIG_MUTATIONS):
        directory = tmp_path / f"c{number}"
        directory.mkdir()
        config = json.loads(json.dumps(base))
        # transformers names the RoPE block rope_scaling or, in newer releases, rope_parameters.
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        target = rope if isinstance(rope, dict) and rng.random() < 0.25 else config
        key = rng.choice(sorted(target))
        if rng.random() < 0.2:
            del target[key]
        else:
            target[key] = rng.choice(HOSTILE_JSON_VALUES)
        text = json.dumps(config)
        if rng.random() < 0.1:
            text = text[: rng.randrange(len(text))]
        (directory / "config.json").write_bytes(text.encode("utf-8", "surrogatepass"))
        spec = {
            "name": "fuzz",
            "model": {"dtype": "fp32", "init_from": str(directory)},
            "training": {"seq_len": 64, "micro_batch": 1, "global_batch": 1, "steps": 1},
            "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
        }
        spec_path = tmp_path / f"c{number}.yaml"
        spec_path.write_text(json.dumps(spec))
        outcomes[_invoke(["validate", str(spec_path)])] += 1
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


def _mutate_line(line: str, rng: random.Random) -> bytes:
    """One seeded mutation of a JSON line, as bytes (some are not UTF-8 on purpose)."""
    operation = rng.randrange(6)
    if operation == 0:
        value = rng.choice(HOSTILE_JSON_VALUES)
        return json.dumps({"text": value}).encode("utf-8", "surrogatepass")
    if operation == 1:
        return line[: rng.randrange(len(line))].encode()
    if operation == 2:
        return json.dumps({"body": "no text field"}).encode()
    if operation == 3:
        depth = rng.choice([10, 1000, 100_000])
        return ('{"text": ' + "[" * depth + "]" * depth + "}").encode()
    if operation == 4:
        cut = rng.randrange(len(line))
        return line[:cut].encode() + bytes([rng.randrange(128, 256)]) + line[cut:].encode()
    return line.encode()


def test_mutated_data_lines_prepare_or_exit_2_leaving_nothing(tmp_path: Path) -> None:
    """JSON lines with a mutated line (a hostile text value, a cut line, a missing field, deep
    nesting, a byte that is not UTF-8): `data prepare` exits 0 having written the .bin and .idx,
    or 2 having written nothing at all (no temporary file, no directory)."""
    tokenizer = distribution("mistral_common").locate_file("mistral_common/data/tokenizer.model.v1")
    rng = random.Random(11)
    good = [json.dumps({"text": f"Document {i} says something."}) for i in range(4)]
    outcomes: Counter[int] = Counter()
    for number in range(DATA_MUTATIONS):
        lines = [line.encode() for line in good]
        lines[rng.randrange(len(lines))] = _mutate_line(rng.choice(good), rng)
        data = tmp_path / f"d{number}.jsonl"
        data.write_bytes(b"\n".join(lines) + b"\n")
        output = tmp_path / f"out{number}" / "x"
        code = _invoke(["data", "prepare", str(data), "-t", str(tokenizer), "-o", str(output)])
        outcomes[code] += 1
        if code == 0:
            assert sorted(os.listdir(output.parent)) == ["x.bin", "x.idx"]
        else:
            assert not output.parent.exists()
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """A file cut short, a few bytes overwritten, random bytes inserted, or nothing left."""
    operation = rng.randrange(4)
    if operation == 0:
        return data[: rng.randrange(len(data))]
    if operation == 1:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if operation == 2:
        cut = rng.randrange(len(data))
        noise = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return data[:cut] + noise + data[cut:]
    return b""


HOSTILE_TOKENIZER_VALUES: list[Any] = [*HOSTILE_JSON_VALUES, 2**63, "(", {"Regex": "("}]
"""What replaces a value inside a tokenizer.json: the JSON values above, an id past any
integer type, and a regular expression that does not compile."""


def _mutate_tokenizer_json(text: str, rng: random.Random) -> bytes:
    """A tokenizer.json with a value somewhere inside it (up to four levels down: the model,
    its vocabulary and merges, the pre-tokenizer, the added tokens) removed or replaced by a
    hostile one, or its bytes mutated."""
    operation = rng.randrange(3)
    if operation == 0:
        return _mutate_bytes(text.encode(), rng)
    data = json.loads(text)
    node: Any = data
    path: list[tuple[Any, Any]] = []
    for _ in range(rng.randint(1, 4)):
        if isinstance(node, dict) and node:
            key: Any = rng.choice(sorted(node))
        elif isinstance(node, list) and node:
            key = rng.randrange(len(node))
        else:
            break
        path.append((node, key))
        node = node[key]
    parent, key = path[-1]
    if operation == 1 and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = rng.choice(HOSTILE_TOKENIZER_VALUES)
    return json.dumps(data).encode("utf-8", "surrogatepass")


def _mutate_tiktoken(text: str, rng: random.Random) -> bytes:
    """A tiktoken BPE file with a line that is not base64, a rank that is not one (text, a
    negative, one past int32), a line repeated (a rank shared) or removed, or its bytes
    mutated."""
    lines = text.splitlines()
    operation = rng.randrange(5)
    where = rng.randrange(len(lines))
    if operation == 0:
        lines[where] = "not base64!! " + str(rng.randrange(10))
    elif operation == 1:
        token = lines[where].split()[0]
        lines[where] = f"{token} {rng.choice(['x', '-5', str(2**40), '1e3', ''])}"
    elif operation == 2:
        lines.insert(where, lines[rng.randrange(len(lines))])
    elif operation == 3:
        del lines[where]
    else:
        return _mutate_bytes(text.encode(), rng)
    return ("\n".join(lines) + "\n").encode()


def _tokenizer_sources(tmp_path: Path) -> dict[str, tuple[str, bytes, dict[str, bytes]]]:
    """Per tokenizer kind: the file name it is written as, its genuine bytes, and the files
    beside it. SentencePiece: Mistral's model; a Hugging Face tokenizer.json: a byte-level BPE
    trained here (with its tokenizer_config.json naming the end-of-document token); tiktoken:
    the first 3,000 ranks of Llama 3's file (its byte tokens and the first merges: a small
    vocabulary of the real format)."""
    from tests.helpers.chat_data import write_chat_tokenizer

    sentencepiece = Path(
        str(distribution("mistral_common").locate_file("mistral_common/data/tokenizer.model.v1"))
    )
    tiktoken = Path(
        str(distribution("llama_models").locate_file("llama_models/llama3/tokenizer.model"))
    )
    trained = write_chat_tokenizer(tmp_path / "trained")
    ranks = "\n".join(tiktoken.read_text().splitlines()[:3000]) + "\n"
    return {
        "sentencepiece": ("tokenizer.model", sentencepiece.read_bytes(), {}),
        "huggingface": (
            "tokenizer.json",
            (trained / "tokenizer.json").read_bytes(),
            {"tokenizer_config.json": (trained / "tokenizer_config.json").read_bytes()},
        ),
        "tiktoken": ("llama3.tiktoken", ranks.encode(), {}),
    }


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_mutated_tokenizer_files_prepare_or_exit_2_leaving_nothing(
    kind: str, tmp_path: Path
) -> None:
    """Each tokenizer kind's file mutated (bytes cut, overwritten or inserted; for a
    tokenizer.json a value inside replaced or removed; for a tiktoken file a line or a rank
    broken): `data prepare` exits 0 having written the .bin and .idx, or 2 with one sentence
    naming the tokenizer file, having written nothing at all. The genuine file prepares."""
    name, genuine, beside = _tokenizer_sources(tmp_path)[kind]
    rng = random.Random(kind)
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Document {i} says hello world."}) + "\n" for i in range(4))
    )
    outcomes: Counter[int] = Counter()
    for number in range(TOKENIZER_MUTATIONS + 1):
        directory = tmp_path / f"{kind}{number}"
        directory.mkdir()
        for other, content in beside.items():
            (directory / other).write_bytes(content)
        mutated = genuine if number == 0 else _mutate_tokenizer(kind, genuine, rng)
        tokenizer = directory / name
        tokenizer.write_bytes(mutated)
        output = directory / "out" / "x"
        result = CliRunner().invoke(
            app, ["data", "prepare", str(data), "-t", str(tokenizer), "-o", str(output)]
        )
        text = " ".join(result.output.split())
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            number,
            text,
            result.exception,
        )
        assert "Traceback" not in result.output and result.exit_code in (0, 2), (number, text)
        outcomes[result.exit_code] += 1
        if result.exit_code == 0:
            assert sorted(os.listdir(output.parent)) == ["x.bin", "x.idx"]
        else:
            assert number > 0, text  # the genuine file prepares
            assert text.startswith(f"error: tokenizer {tokenizer}: "), (number, text)
            assert text.count("error:") == 1, (number, text)
            assert sorted(os.listdir(directory)) == sorted([name, *beside]), number
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


def _mutate_tokenizer(kind: str, genuine: bytes, rng: random.Random) -> bytes:
    if kind == "huggingface":
        return _mutate_tokenizer_json(genuine.decode(), rng)
    if kind == "tiktoken":
        return _mutate_tiktoken(genuine.decode(), rng)
    return _mutate_bytes(genuine, rng)
