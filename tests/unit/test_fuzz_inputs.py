"""Seeded mutations of what a user hands the commands: every example spec (to `validate` and
`render`), the example sweep (to `sweep --dry-run`), a Hugging Face config.json under
`model.init_from` (to `validate`), JSON lines and chat lines, chat templates and
tokenizer_config.json (to `data prepare`), every kind of tokenizer file `data prepare` reads,
`--set` paths (to `validate`), and what ctxlaunch reads back from its own state: job and sweep
records and a run's files (to `status`, `list` and `report`). Each outcome must be exit 0 or 2
with no traceback, no code run from the input, and nothing half-written. The seeds are fixed,
so a failure reproduces; the counts are bounded so the whole file runs in seconds."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest

from ctxlaunch.cli import app
from tests.helpers.cli import CliRunner
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


SWEEP_MUTATIONS = 16
RECORD_MUTATIONS = 24
"""Mutations of a job record, a sweep record and a run's files, in turn."""
CHAT_MUTATIONS = 20
"""Mutations of chat lines, of the chat template and of tokenizer_config.json, each."""
SET_PATH_MUTATIONS = 40


def test_mutated_sweep_files_expand_or_exit_2(tmp_path: Path) -> None:
    """The example sweep mutated as the specs are (its base made absolute): `sweep --dry-run`
    exits 0 or 2, no tag runs code."""
    rng = random.Random("sweep")
    marker = tmp_path / "code-ran"
    text = (ROOT / "jobs" / "sweeps" / "demo.yaml").read_text()
    text = text.replace("base: ../demo.yaml", f"base: {ROOT / 'jobs' / 'demo.yaml'}")
    outcomes: Counter[int] = Counter()
    for number in range(SWEEP_MUTATIONS):
        path = tmp_path / f"s{number}.yaml"
        path.write_bytes(_mutate_yaml(text, rng, marker).encode("utf-8", "surrogatepass"))
        outcomes[_invoke(["sweep", str(path), "--dry-run"])] += 1
        assert not marker.exists(), f"{path}: the YAML ran a command"
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


def _mutate_json_value(data: Any, rng: random.Random) -> bytes:
    """A JSON document with a value somewhere inside it (up to three levels down) removed or
    replaced by a hostile one, or its text cut short or its bytes mutated."""
    operation = rng.randrange(4)
    text = json.dumps(data)
    if operation == 0:
        return text[: rng.randrange(len(text))].encode()
    if operation == 1:
        return _mutate_bytes(text.encode(), rng)
    copy = json.loads(text)
    node: Any = copy
    parent, key = None, None
    for _ in range(rng.randint(1, 3)):
        if isinstance(node, dict) and node:
            parent, key = node, rng.choice(sorted(node))
        elif isinstance(node, list) and node:
            parent, key = node, rng.randrange(len(node))
        else:
            break
        node = parent[key]
    if parent is None:
        return json.dumps(rng.choice(HOSTILE_JSON_VALUES)).encode("utf-8", "surrogatepass")
    if operation == 2 and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = rng.choice(HOSTILE_JSON_VALUES)
    return json.dumps(copy).encode("utf-8", "surrogatepass")


def _state(home: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """A finished local job's record, a one-point sweep record of it and its run files, as
    ctxlaunch writes them."""
    from ctxlaunch.contract.loader import load_spec

    job_id = "local-demo-20260101-000000-abcd"
    record = {
        "id": job_id,
        "name": "demo",
        "target": "local",
        "created": 1.0,
        "backend_id": job_id,
        "command": ["torchrun"],
        "artifact": "spec.json",
        "extra": {"exit_status": 0, "rank_exit_codes": [0, 0], "restarts": 0},
    }
    spec = load_spec(ROOT / "jobs" / "demo.yaml", ["training.seq_len=2048"])
    sweep = {
        "id": "sweep-demo-1",
        "name": "demo",
        "target": "local",
        "created": 1.0,
        "axes": ["training.seq_len"],
        "points": [
            {
                "index": 0,
                "name": "demo-2048",
                "values": {"training.seq_len": 2048},
                "job": job_id,
                "skipped": None,
                "spec": spec.model_dump(mode="json"),
            },
        ],
    }
    files = {
        "summary.json": json.dumps(
            {
                "tokens_per_second_per_gpu": 900.0,
                "step_seconds": 1.1,
                "final_loss": 2.0,
                "attention_balance": 1.0,
                "peak_memory_bytes_per_rank": [2**30, 2**30],
            }
        ).encode(),
        "eval.jsonl": json.dumps(
            {
                "loss": 2.0,
                "buckets": [{"tokens": 10, "loss": 2.1}],
                "passkey": [{"trials": 2, "retrieved": 1}],
            }
        ).encode()
        + b"\n",
        "events.jsonl": b'{"event":"step","time":1.0,"step":1,"loss":2.0}\n',
    }
    return record, sweep, files


def test_mutated_job_records_sweep_records_and_run_files_exit_0_or_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job record, a sweep record and a run's files (summary, evaluation and events logs)
    mutated one at a time: `status` and `report` exit 0 or 2 (a damaged record is named), and
    `list` always exits 0, naming a record it skips."""
    rng = random.Random("records")
    outcomes: Counter[int] = Counter()
    for number in range(RECORD_MUTATIONS):
        home = tmp_path / f"h{number}"
        monkeypatch.setenv("CTXLAUNCH_HOME", str(home))
        record, sweep, files = _state(home)
        job_dir = home / "jobs" / record["id"]
        job_dir.mkdir(parents=True)
        (home / "sweeps").mkdir()
        contents = {
            job_dir / "job.json": json.dumps(record).encode(),
            home / "sweeps" / "sweep-demo-1.json": json.dumps(sweep).encode(),
            **{job_dir / name: data for name, data in files.items()},
        }
        target = sorted(contents)[number % len(contents)]
        original = json.loads(contents[target].splitlines()[0])
        contents[target] = _mutate_json_value(original, rng)
        for path, data in contents.items():
            path.write_bytes(data)
        outcomes[_invoke(["status", record["id"]])] += 1
        outcomes[_invoke(["report", "sweep-demo-1"])] += 1
        assert _invoke(["list"]) == 0
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


HOSTILE_TEMPLATE_PIECES = [
    "{% include 'x' %}",
    "{{ 'a' * 99999999999 }}",
    "{% for i in range(999999999) %}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ messages[99] }}",
    "{{ raise_exception('no') }}",
    "{{ 1 / 0 }}",
    "{{ ''.__class__ }}",
    "{% for",
    "{{ x.y.z }}",
]
"""What a hostile or broken chat template holds: includes, unbounded sizes, recursion, errors
of its own, sandbox escapes, syntax cut short."""


def _mutate_template(template: str, rng: random.Random) -> str:
    """A chat template with a hostile piece inserted, a character inserted or removed, or its
    text cut short."""
    operation = rng.randrange(4)
    cut = rng.randrange(len(template))
    if operation == 0:
        return template[:cut] + rng.choice(HOSTILE_TEMPLATE_PIECES) + template[cut:]
    if operation == 1:
        return template[:cut] + rng.choice(HOSTILE_CHARACTERS + ["{", "}", "%"]) + template[cut:]
    if operation == 2:
        return template[:cut] + template[cut + 1 :]
    return template[:cut]


HOSTILE_MESSAGES: list[Any] = [
    *HOSTILE_JSON_VALUES,
    [{"role": "user"}],
    [{"role": 5, "content": "x"}],
    [{"role": "user", "content": ["a", "b"]}],
    [{"role": "user", "content": 7}],
]
"""A chat line's messages that no conversation can be (each is refused naming the line)."""
ODD_MESSAGES: list[Any] = [
    [
        {"role": "user", "content": "<|im_end|> is text here"},
        {"role": "assistant", "content": "ok"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "x " * 50_000}],
    [{"role": "user", "content": "東京 ✓ über"}, {"role": "assistant", "content": "naïve café"}],
]
"""Messages that are odd but a conversation (they prepare)."""


@pytest.mark.parametrize("what", ["chat lines", "chat template", "tokenizer config"])
def test_mutated_chat_data_templates_and_tokenizer_configs_prepare_or_exit_2(
    what: str, tmp_path: Path
) -> None:
    """Chat lines with hostile messages, the chat template mutated (hostile pieces inserted,
    its text broken), or tokenizer_config.json mutated: `data prepare --chat` exits 0 having
    written the .bin, .idx and .lossmask, or 2 having written nothing."""
    from tests.helpers.chat_data import conversations, write_chat_jsonl, write_chat_tokenizer

    rng = random.Random(what)
    genuine = write_chat_tokenizer(tmp_path / "tokenizer")
    chats = tmp_path / "chats.jsonl"
    write_chat_jsonl(chats, conversations(3))
    template = json.loads((genuine / "tokenizer_config.json").read_text())["chat_template"]
    outcomes: Counter[int] = Counter()
    for number in range(CHAT_MUTATIONS):
        directory = tmp_path / f"t{number}"
        shutil.copytree(genuine, directory)
        data = chats
        if what == "chat lines":
            lines = chats.read_text().splitlines()
            where = rng.randrange(len(lines))
            messages = rng.choice(HOSTILE_MESSAGES if rng.random() < 0.6 else ODD_MESSAGES)
            lines[where] = json.dumps({"messages": messages})
            data = tmp_path / f"c{number}.jsonl"
            data.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n")
        elif what == "chat template":
            (directory / "chat_template.jinja").write_text(_mutate_template(template, rng))
        else:
            config = json.loads((genuine / "tokenizer_config.json").read_text())
            (directory / "tokenizer_config.json").write_bytes(_mutate_json_value(config, rng))
        output = tmp_path / f"out{number}" / "x"
        code = _invoke(
            ["data", "prepare", str(data), "-t", str(directory), "-o", str(output), "--chat"]
        )
        outcomes[code] += 1
        if code == 0:
            assert sorted(os.listdir(output.parent)) == ["x.bin", "x.idx", "x.lossmask"]
        else:
            assert not output.parent.exists()
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes


SET_PARTS = [
    "training",
    "model",
    "parallel",
    "cluster",
    "fabric",
    "env",
    "nccl",
    "steps",
    "seq_len",
    "cp",
    "preset",
    "name",
    "checkpoint",
    "dir",
    "0",
    "-1",
    "é",
    "x" * 300,
    "__class__",
    "\x00",
    " ",
    "[0]",
]
"""Parts a hostile `--set` path is made of: real sections and fields, indices, non-ASCII,
a part longer than a file name, a NUL, Python's attributes."""


PLAIN_SETS = ["training.steps=4", "parallel.cp=1", "training.seed=7", "name=renamed"]
"""Overrides as a user means them."""


def test_mutated_set_paths_validate_or_exit_2() -> None:
    """`--set` paths of real and hostile parts, empty parts, and depths up to thousands (a path
    of 2,000 parts ended in a RecursionError), with hostile values: `validate` exits 0 or 2."""
    rng = random.Random("set paths")
    outcomes: Counter[int] = Counter()
    for _ in range(SET_PATH_MUTATIONS):
        depth = rng.choice([1, 2, 3, 5, 64, 65, 2000])
        parts = [rng.choice(SET_PARTS) for _ in range(depth)]
        if rng.random() < 0.1:
            parts[rng.randrange(depth)] = ""
        value = rng.choice(HOSTILE_SCALARS).format(marker="/nonexistent/marker")
        hostile = ".".join(parts) + "=" + value
        # Half beside a field set as it should be, so that some paths reach an outcome of 0.
        sets = [hostile] if rng.random() < 0.5 else [rng.choice(PLAIN_SETS)]
        if rng.random() < 0.5:
            sets.append(f"fabric.env.{rng.choice(SET_PARTS).upper()}={rng.choice(['1', 'x'])}")
        args = [arg for override in sets for arg in ("--set", override)]
        outcomes[_invoke(["validate", str(ROOT / "jobs" / "demo.yaml"), *args])] += 1
    assert outcomes[0] > 0 and outcomes[2] > 0, outcomes
