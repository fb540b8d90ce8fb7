"""Supervised fine-tuning at length: chat data through the tokenizer's own chat template with a
loss mask on the assistant's turns (`data prepare --chat`), trained with the loss counted only
there. References: transformers' `apply_chat_template` for the tokens, transformers' model with
labels -100 outside the mask for the loss (on a tiny Qwen2 checkpoint saved with
save_pretrained, biases and norm gains random), one process for every layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ctxlaunch.cli import app
from ctxlaunch.contract.loader import apply_overrides, validate_spec
from ctxlaunch.runtime.data.chat import prepare_chat
from ctxlaunch.runtime.data.indexed import IndexedDataset
from tests.helpers.chat_data import (
    VOCAB_SIZE,
    conversations,
    write_chat_jsonl,
    write_chat_tokenizer,
)
from tests.helpers.cli import CliRunner
from tests.helpers.dist import run_distributed
from tests.helpers.hf_models import hf_config, save_hf
from tests.helpers.trainer_steps import evaluate_rank, train_steps

SEQ_LEN = 128
runner = CliRunner()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer, 24 conversations prepared with --chat, and a tiny Qwen2 checkpoint of
    the tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("sft")
    tokenizer = write_chat_tokenizer(root / "tokenizer")
    chats = conversations(24)
    write_chat_jsonl(root / "chats.jsonl", chats)
    (root / "chats.json").write_text(json.dumps(chats))
    prepare_chat([root / "chats.jsonl"], tokenizer, root / "data")
    save_hf(root / "qwen2", hf_config(family="qwen2", vocab=VOCAB_SIZE))
    return root


def _their_ids(tokenizer, messages) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_chat_tokens_equal_apply_chat_template_and_the_mask_is_the_assistant(chat_dir) -> None:
    """Document for document, the ids are transformers' apply_chat_template of the same
    messages, and the supervised tokens decode to exactly each assistant turn's content and
    its end-of-turn (not the role header the generation prompt supplies)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_dir / "tokenizer"))
    chats = json.loads((chat_dir / "chats.json").read_text())
    data = IndexedDataset(chat_dir / "data")
    mask = data.loss_mask()
    assert len(data) == len(chats)
    for number, messages in enumerate(chats):
        ours = data.document(number).tolist()
        assert ours == _their_ids(tokenizer, messages), number
        start, stop = data.document_starts[number], data.document_starts[number + 1]
        supervised = [t for t, keep in zip(ours, mask[start:stop], strict=True) if keep]
        want = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert tokenizer.decode(supervised) == want, number


def test_prepare_chat_cli_writes_the_mask_and_refuses_bad_lines(chat_dir, tmp_path) -> None:
    """The CLI writes PREFIX.bin, .idx and .lossmask; a line without messages exits 2 naming
    the file and line, and nothing is written."""
    out = tmp_path / "ok"
    result = runner.invoke(
        app,
        [
            "data",
            "prepare",
            str(chat_dir / "chats.jsonl"),
            "--chat",
            "-t",
            str(chat_dir / "tokenizer"),
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "supervised" in result.output
    assert (tmp_path / "ok.lossmask").read_bytes() == (chat_dir / "data.lossmask").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no chat"}\n')
    result = runner.invoke(
        app,
        [
            "data",
            "prepare",
            str(bad),
            "--chat",
            "-t",
            str(chat_dir / "tokenizer"),
            "-o",
            str(tmp_path / "bad"),
        ],
    )
    assert result.exit_code == 2
    assert f"{bad}:2" in result.output and "messages" in result.output
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".bad", "bad.")))
    assert left == ["bad.jsonl"]  # no .bin, .idx, .lossmask or temporary file


@pytest.mark.parametrize("case", ["lone surrogate", "nested 100000 deep"])
def test_prepare_chat_refuses_hostile_lines_naming_them(chat_dir, tmp_path, case) -> None:
    """A chat turn holding a lone surrogate (the Rust tokenizer cannot take it) and a line
    nested past the JSON parser's recursion limit: exit 2 naming file:line, nothing written."""
    bad = tmp_path / "bad.jsonl"
    if case == "lone surrogate":
        bad.write_text('{"messages": [{"role": "user", "content": "a \\udc00 b"}]}\n')
        expected = "bad.jsonl:1: the text holds a lone surrogate U+DC00"
    else:
        bad.write_text('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
        expected = "bad.jsonl:1: JSON nested too deep to read"
    args = ["data", "prepare", str(bad), "--chat", "-t", str(chat_dir / "tokenizer")]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "new" / "bad")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert expected in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def sft_spec(chat_dir: Path, world: int = 1, **changes: object) -> dict:
    """Two steps of SFT from the tiny Qwen2 checkpoint on the prepared chats, global batch 4."""
    base = {
        "name": "sft",
        "model": {"init_from": str(chat_dir / "qwen2"), "dtype": "fp32"},
        "training": {
            "seq_len": SEQ_LEN,
            "micro_batch": 1,
            "global_batch": 4,
            "steps": 2,
            "seed": 7,
            "optimizer": {"lr": 1e-3, "warmup_steps": 1},
            "data": {"source": "tokens", "path": str(chat_dir / "data"), "loss_mask": True},
        },
        "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": world},
    }
    data = apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in changes.items()])
    return validate_spec(data).model_dump(mode="json")


def packed_pieces(
    tokens: np.ndarray, mask: np.ndarray, doc_of: np.ndarray, windows: int, document_mask: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) as transformers would be given them, computed without the
    trainer's code: window j is tokens [j*S, j*S + S + 1) of the documents end to end, labels
    -100 where the mask leaves the target out; under a document mask each document's piece of
    a window alone (the targets that open the next document -100 too)."""
    pieces = []
    for j in range(windows):
        window = slice(j * SEQ_LEN, j * SEQ_LEN + SEQ_LEN + 1)
        ids, keep, docs = tokens[window], mask[window], doc_of[window]
        labels = np.where(keep[1:], ids[1:], -100)
        if not document_mask:
            pieces.append((torch.from_numpy(ids[:-1]), torch.from_numpy(labels)))
            continue
        labels = np.where(docs[1:] == docs[:-1], labels, -100)
        bounds = [0] + [i for i in range(1, SEQ_LEN) if docs[i] != docs[i - 1]] + [SEQ_LEN]
        for start, stop in zip(bounds, bounds[1:], strict=False):
            pieces.append((torch.from_numpy(ids[start:stop]), torch.from_numpy(labels[start:stop])))
    return pieces


def reference_pieces(
    chat_dir: Path, document_mask: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first step's four sequences (every document trains: no held-out split)."""
    data = IndexedDataset(chat_dir / "data")
    doc_of = np.repeat(np.arange(len(data)), data.document_lengths())
    return packed_pieces(
        np.asarray(data.tokens, dtype=np.int64),
        np.asarray(data.loss_mask(), dtype=bool),
        doc_of,
        4,
        document_mask,
    )


def their_loss(reference, pieces) -> tuple[float, int, list[float]]:  # type: ignore[no-untyped-def]
    """transformers' summed loss over the pieces' supervised targets, their count, and each
    piece's own mean (pieces with a supervised target)."""
    total, count, means = 0.0, 0, []
    with torch.no_grad():
        for ids, labels in pieces:
            logits = reference(ids[None]).logits[0]
            losses = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
            supervised = int((labels != -100).sum())
            total += float(losses.sum())
            count += supervised
            if supervised:
                means.append(float(losses.sum()) / supervised)
    return total, count, means


@pytest.mark.parametrize("document_mask", [False, True])
def test_one_process_equals_transformers_with_labels_masked(chat_dir, document_mask) -> None:
    """The first step's loss is transformers' mean cross-entropy over every supervised target
    of the step's packed sequences (each document alone under a document mask); the mean of
    per-sequence means (what a per-rank mean at DP 4 reports) is far from it, so this test
    tells them apart."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(chat_dir / "qwen2")).float().eval()
    got = train_steps(0, 1, sft_spec(chat_dir, **{"training.data.document_mask": document_mask}), 1)
    total, count, per_sequence = their_loss(reference, reference_pieces(chat_dir, document_mask))
    want = total / count
    per_rank_mean = sum(per_sequence) / len(per_sequence)
    print(
        f"document_mask={document_mask}: loss {got['losses'][0]:.7f}, transformers {want:.7f} "
        f"(|diff| {abs(got['losses'][0] - want):.1e}; a per-piece mean {per_rank_mean:.7f}), "
        f"{count} supervised targets"
    )
    assert got["losses"][0] == pytest.approx(want, rel=1e-5)
    assert abs(per_rank_mean - want) > 1e-3  # the wrong normalisation would fail above


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_evaluation_counts_the_supervised_targets_at_cp2(chat_dir) -> None:
    """Held-out conversations (eval_fraction) under a document mask: the evaluation loss at CP 2
    (ring) is transformers' mean over the supervised targets of the held-out windows, each
    document's piece alone, not scaled by the CP degree."""
    from transformers import AutoModelForCausalLM

    from ctxlaunch.runtime.data.packing import held_out

    changes = {
        "training.data.document_mask": True,
        "training.data.eval_fraction": 0.4,
        "training.eval": {"sequences": 2, "buckets": 2, "passkey": {"enabled": False}},
        "parallel.cp": 2,
    }
    spec = sft_spec(chat_dir, 2, **changes)
    got = run_distributed(evaluate_rank, 2, spec, timeout_s=240)[0]
    data = IndexedDataset(chat_dir / "data")
    chosen = np.flatnonzero(held_out(len(data), 0.4))
    tokens = np.concatenate([np.asarray(data.document(int(d)), dtype=np.int64) for d in chosen])
    mask = np.concatenate(
        [
            np.asarray(data.loss_mask()[data.document_starts[d] : data.document_starts[d + 1]])
            for d in chosen
        ]
    ).astype(bool)
    doc_of = np.repeat(chosen, data.document_lengths()[chosen])
    reference = AutoModelForCausalLM.from_pretrained(str(chat_dir / "qwen2")).float().eval()
    total, count, _ = their_loss(reference, packed_pieces(tokens, mask, doc_of, 2, True))
    print(f"held-out loss at CP 2 {got['loss']:.7f}, transformers {total / count:.7f}")
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)


def _train_all(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [train_steps(rank, world, spec, 2) for spec in specs]


def compare(got: dict, want: dict, what: str) -> float:
    """Losses of both steps and every gradient of the first, within the document-mask tests'
    tolerances; the worst gradient difference relative to the gradient's largest entry."""
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6
    )
    worst = 0.0
    for name, grad in want["grads"].items():
        a, b = torch.from_numpy(got["grads"][name]), torch.from_numpy(grad)
        torch.testing.assert_close(
            a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
        relative = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        assert relative <= 1e-5, f"{what}: gradient of {name} differs by {relative:.2e}"
        worst = max(worst, relative)
    return worst


LAYOUTS: dict[int, list[dict]] = {
    2: [
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring"},
        {"parallel.cp": 2, "parallel.cp_algorithm": "ring", "parallel.cp_sharding": "contiguous"},
        {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"},
        {},  # DP 2: the ranks hold different numbers of supervised targets
        {"parallel.tp": 2},
        {"parallel.pp": 2},
        {"parallel.cp": 2, "training.zero_stage": 2},  # DeepSpeed ZeRO-2 (engine auto)
        {"training.zero_stage": 2, "training.engine": "fsdp2"},  # FSDP2 at DP 2
    ],
    4: [
        {"parallel.cp": 4, "parallel.cp_algorithm": "ring"},
        {"parallel.cp": 4, "parallel.cp_algorithm": "hybrid", "parallel.ulysses_degree": 2},
    ],
}


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=lambda w: f"world{w}")
def test_sft_loss_and_gradients_at_every_layout_equal_one_process(chat_dir, world) -> None:
    """Under a document mask with restarted positions: CP 2 (ring zigzag and contiguous,
    Ulysses), DP 2, TP 2, PP 2, DeepSpeed ZeRO-2 at CP 2, FSDP2 at DP 2, CP 4 ring and hybrid
    give one process's losses and first-step gradients; the mask is cut with the tokens
    before the split."""
    common = {"training.data.document_mask": True}
    want = train_steps(0, 1, sft_spec(chat_dir, **common), 2)
    specs = [sft_spec(chat_dir, world, **common, **layout) for layout in LAYOUTS[world]]
    got = run_distributed(_train_all, world, specs, timeout_s=560)[0]
    for layout, result in zip(LAYOUTS[world], got, strict=True):
        worst = compare(result, want, str(layout or "dp 2"))
        print(f"{layout or 'dp 2'}: worst relative gradient difference {worst:.2e}")


def test_a_loss_mask_needs_tokens_and_its_file(chat_dir, tmp_path) -> None:
    """loss_mask on a source without documents is refused by name; a dataset without its
    PREFIX.lossmask is reported missing (validation warns, the trainer refuses to start) and
    refused by the reader with the file and the command that writes it."""
    from ctxlaunch.contract.loader import SpecError
    from ctxlaunch.runtime.data.indexed import IndexedDataError

    with pytest.raises(SpecError, match=r"training\.data\.loss_mask.*source = tokens"):
        validate_spec(
            apply_overrides(
                validate_spec(sft_spec(chat_dir)).model_dump(mode="json"),
                ['training.data={"source": "synthetic", "loss_mask": true}'],
            )
        )
    for suffix in (".bin", ".idx"):
        (tmp_path / f"plain{suffix}").write_bytes((chat_dir / f"data{suffix}").read_bytes())
    spec = validate_spec(sft_spec(chat_dir, **{"training.data.path": str(tmp_path / "plain")}))
    missing = spec.training.data.missing_files()
    assert len(missing) == 1 and "plain.lossmask" in missing[0] and "--chat" in missing[0]
    with pytest.raises(IndexedDataError, match=r"plain\.lossmask: no such file.*--chat"):
        IndexedDataset(tmp_path / "plain").loss_mask()
