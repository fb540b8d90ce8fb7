"""Evaluation at length: the passkey prompts, the per-bucket loss and passkey scores the same at
every layout (CP ring and Ulysses, TP, DP with FSDP2) as one process and as a direct forward
of the whole model, evaluation during training, and `ctxlaunch eval` end to end through
torchrun (real gloo processes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctxlaunch.contract.loader import apply_overrides, validate_spec
from ctxlaunch.runtime.evaluation.eval_data import (
    PASSKEY_PREFIX,
    PASSKEY_QUESTION,
    bucket_edges,
    passkey_needle,
    passkey_probe,
)
from ctxlaunch.runtime.records import EvalResult
from tests.helpers.dist import run_distributed
from tests.helpers.paths import TEXT_CORPUS
from tests.helpers.trainer_steps import evaluate_rank

CTXLAUNCH = str(Path(sys.executable).parent / "ctxlaunch")
TEXT = TEXT_CORPUS


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_bucket_edges_double_up_to_the_sequence() -> None:
    assert bucket_edges(8192, 6) == [0, 256, 512, 1024, 2048, 4096, 8192]
    assert bucket_edges(1024, 1) == [0, 1024]
    assert bucket_edges(4, 6) == [0, 1, 2, 4]  # too short to halve five times


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_has_the_length_the_needle_at_its_depth_and_the_answer_last(depth) -> None:
    probe = passkey_probe(encode, 600, depth, 48213)
    assert len(probe.tokens) == 600
    text = bytes(probe.tokens).decode()
    assert text.endswith(f"{PASSKEY_QUESTION} 48213")
    needle = passkey_needle(48213)
    # The needle sits `depth` of the way through the filler between instructions and question.
    filler_start = len(PASSKEY_PREFIX)
    filler_stop = text.index(PASSKEY_QUESTION)
    room = filler_stop - filler_start - len(needle)
    assert text.index(needle) - filler_start == round(depth * room)
    # The answer targets are the answer's tokens: targets[i] = tokens[i + 1].
    targets = probe.tokens[1:]
    assert bytes(targets[i] for i in probe.answer_targets).decode() == " 48213"


def test_a_prompt_too_short_for_the_instructions_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        passkey_probe(encode, 100, 0.5, 12345)


def test_passkey_lengths_longer_than_the_sequence_are_refused() -> None:
    from ctxlaunch.contract.loader import SpecError

    with pytest.raises(SpecError, match=r"training\.eval\.passkey\.lengths\[0\].*seq_len = 512"):
        validate_spec(base_spec(**{"training.eval.passkey.lengths": [1024]}))


def test_evaluation_during_training_with_a_pipeline_is_refused() -> None:
    from ctxlaunch.contract.loader import SpecError

    with pytest.raises(SpecError, match=r"training\.eval\.interval.*pp = 1"):
        validate_spec(
            base_spec(**{"training.eval.interval": 1, "parallel.pp": 2, "cluster.gpus_per_node": 2})
        )


BASE = {
    "name": "evaltest",
    "model": {"preset": "tiny", "dtype": "fp32"},
    "training": {
        "seq_len": 512,
        "steps": 2,
        "seed": 3,
        "log_interval": 1,
        "optimizer": {"lr": 3e-3},
        "data": {"source": "text", "path": str(TEXT)},
        "eval": {
            "sequences": 3,
            "buckets": 3,
            "passkey": {"lengths": [320, 512], "depths": [0.0, 1.0], "trials": 1},
        },
    },
    "cluster": {"target": "local", "gpu": "cpu", "gpus_per_node": 1},
}


def base_spec(**changes) -> dict:
    return apply_overrides(BASE, [f"{k}={json.dumps(v)}" for k, v in changes.items()])


def _train_and_save(rank: int, world: int, spec_data: dict) -> None:
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    trainer = Trainer(spec, ctx, torch.device("cpu"), log=lambda _: None)
    trainer.run()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model trained two steps on byte-level text, checkpointed."""
    directory = tmp_path_factory.mktemp("eval") / "ckpt"
    data = base_spec(**{"training.checkpoint.dir": str(directory)})
    run_distributed(_train_and_save, 1, validate_spec(data).model_dump(mode="json"), timeout_s=120)
    return directory / "step-00000002"


def evaluate(world: int, path: Path, **changes) -> EvalResult:
    data = validate_spec(base_spec(**{"cluster.gpus_per_node": world}, **changes))
    values = run_distributed(
        evaluate_rank, world, data.model_dump(mode="json"), str(path), timeout_s=180
    )
    assert all(v == values[0] for v in values)  # every rank has the job's totals
    return EvalResult.from_dict(values[0])


@pytest.fixture(scope="module")
def single(checkpoint) -> EvalResult:
    return evaluate(1, checkpoint)


def direct_scores(checkpoint: Path) -> tuple[list[float], list[list[bool]]]:
    """The oracle, without the evaluator: the whole model in this process, logits of every
    held-out sequence and prompt at once."""
    from ctxlaunch.runtime.checkpointing.reshard import CheckpointState
    from ctxlaunch.runtime.evaluation.eval_data import held_out, passkey_probes
    from ctxlaunch.runtime.modeling.model import Transformer
    from ctxlaunch.runtime.modeling.weight_sharding import shardings

    spec = validate_spec(base_spec())
    model = Transformer.from_spec(spec.model)
    CheckpointState(
        list(model.named_parameters()), None, None, shardings(model), 1, None, torch.device("cpu")
    ).load(checkpoint)
    data = held_out(spec)
    positions = torch.arange(spec.training.seq_len)
    losses = []
    with torch.no_grad():
        for sequence in data.sequences:
            hidden = model.hidden_states(sequence[None, :-1], positions)
            logits = torch.nn.functional.linear(hidden, model.head.weight)[0]
            losses += torch.nn.functional.cross_entropy(logits, sequence[1:], reduction="none")
        hits = []
        assert data.encode is not None
        for probe in passkey_probes(spec, data.encode):
            tokens = torch.tensor(probe.tokens)
            hidden = model.hidden_states(tokens[None, :-1], positions[: len(tokens) - 1])
            logits = torch.nn.functional.linear(hidden, model.head.weight)[0]
            hits.append([bool(logits[i].argmax() == tokens[i + 1]) for i in probe.answer_targets])
    return [float(x) for x in losses], hits


@pytest.mark.timeout(300)
def test_single_process_evaluation_is_the_direct_forward(checkpoint, single) -> None:
    losses, hits = direct_scores(checkpoint)
    assert single.tokens == len(losses) == 3 * 512
    assert single.loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    edges = bucket_edges(512, 3)
    for bucket, (start, stop) in zip(
        single.buckets, zip(edges, edges[1:], strict=False), strict=True
    ):
        mine = [loss for i, loss in enumerate(losses) if start <= i % 512 < stop]
        assert (bucket.start, bucket.stop, bucket.tokens) == (start, stop, len(mine))
        assert bucket.loss == pytest.approx(sum(mine) / len(mine), rel=1e-6)
        assert bucket.perplexity == pytest.approx(math.exp(bucket.loss))
    # Cells in order: (320, 0.0), (320, 1.0), (512, 0.0), (512, 1.0), one trial each.
    assert [(c.length, c.depth, c.trials) for c in single.passkey] == [
        (320, 0.0, 1),
        (320, 1.0, 1),
        (512, 0.0, 1),
        (512, 1.0, 1),
    ]
    for cell, probe_hits in zip(single.passkey, hits, strict=True):
        assert cell.retrieved == int(all(probe_hits))
        assert cell.token_accuracy == pytest.approx(sum(probe_hits) / len(probe_hits))


LAYOUTS = [
    (2, {"parallel.cp": 2, "parallel.cp_algorithm": "ring"}),
    (2, {"parallel.tp": 2}),
    (2, {"training.zero_stage": 2, "training.engine": "fsdp2"}),  # DP 2, FSDP2 shards
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case", LAYOUTS, ids=lambda c: "-".join(f"{k.split('.')[-1]}={v}" for k, v in c[1].items())
)
def test_every_layout_scores_what_one_process_scores(case, checkpoint, single) -> None:
    world, changes = case
    got = evaluate(world, checkpoint, **changes)
    assert got.tokens == single.tokens and got.sequences == single.sequences
    assert got.loss == pytest.approx(single.loss, rel=1e-5)
    for mine, theirs in zip(got.buckets, single.buckets, strict=True):
        assert (mine.start, mine.stop, mine.tokens) == (theirs.start, theirs.stop, theirs.tokens)
        assert mine.loss == pytest.approx(theirs.loss, rel=1e-5)
    assert [(c.retrieved, round(c.token_accuracy, 6)) for c in got.passkey] == [
        (c.retrieved, round(c.token_accuracy, 6)) for c in single.passkey
    ]


def _train_with_eval(rank: int, world: int, spec_data: dict, run_dir: str) -> list[dict]:
    from ctxlaunch.runtime.parallel.context import build_context
    from ctxlaunch.runtime.trainer.loop import Trainer

    spec = validate_spec(spec_data)
    ctx = build_context(spec.parallel_dims, rank=rank)
    seen: list[dict] = []
    trainer = Trainer(
        spec, ctx, torch.device("cpu"), Path(run_dir) if rank == 0 else None, log=lambda _: None
    )
    trainer.run(eval_observers=[lambda result: seen.append(result.to_dict())])
    return seen


@pytest.mark.timeout(300)
def test_evaluation_every_interval_during_training(tmp_path) -> None:
    from ctxlaunch.contract.events import read_events

    data = validate_spec(
        base_spec(
            **{
                "training.steps": 4,
                "training.eval.interval": 2,
                "parallel.cp": 2,
                "cluster.gpus_per_node": 2,
            }
        )
    )
    seen = run_distributed(
        _train_with_eval, 2, data.model_dump(mode="json"), str(tmp_path), timeout_s=240
    )
    assert [r["step"] for r in seen[0]] == [2, 4] and seen[0] == seen[1]
    written = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert written == seen[0]
    assert written[1]["loss"] < written[0]["loss"]  # the model learns between the two
    events = [e for e in read_events(tmp_path) if e.kind == "eval"]
    assert [e.get("step") for e in events] == [2, 4]


def test_telemetry_exports_the_evaluation() -> None:
    from ctxlaunch.runtime.records import Bucket, PasskeyCell
    from ctxlaunch.runtime.telemetry.training import TrainingTelemetry

    spec = validate_spec(base_spec(**{"telemetry.prometheus": "off"}))
    telemetry = TrainingTelemetry(spec, rank=0, local_rank=0, device=torch.device("cpu"))
    result = EvalResult(
        step=6,
        sequences=1,
        tokens=512,
        loss=2.5,
        perplexity=math.exp(2.5),
        buckets=[
            Bucket(0, 256, 256, 3.0, math.exp(3.0)),
            Bucket(256, 512, 256, 2.0, math.exp(2.0)),
        ],
        passkey=[PasskeyCell(512, 0.5, 2, 1, 0.75)],
    )
    telemetry.on_eval(result)
    exporter = telemetry.exporter

    def value(name: str, **labels: str) -> float | None:
        return exporter.registry.get_sample_value(name, {**exporter.identity.labels(), **labels})

    assert value("ctxlaunch_eval_loss", bucket="0-256") == 3.0
    assert value("ctxlaunch_eval_loss", bucket="256-512") == 2.0
    assert value("ctxlaunch_eval_loss", bucket="all") == 2.5
    assert value("ctxlaunch_passkey_retrieval_ratio", length="512", depth="0.5") == 0.5
    assert value("ctxlaunch_eval_step") == 6
    telemetry.close()


@pytest.mark.timeout(300)
def test_the_eval_command_runs_the_layout_through_torchrun(tmp_path, checkpoint, single) -> None:
    import yaml

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            base_spec(
                **{
                    "training.checkpoint.dir": str(checkpoint.parent),
                    "parallel.cp": 2,
                    "cluster.gpus_per_node": 2,
                }
            )
        )
    )
    done = subprocess.run(
        [CTXLAUNCH, "eval", str(spec_path), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["checkpoint"] == str(checkpoint)
    assert result["loss"] == pytest.approx(single.loss, rel=1e-5)


def test_the_console_table_shows_buckets_and_passkey_cells(single) -> None:
    lines = single.lines()
    assert lines[0].startswith(f"held-out loss {single.loss:.4f}")
    assert lines[1].split() == ["context", "length", "tokens", "loss", "perplexity"]
    assert len(lines) == 2 + len(single.buckets) + 1 + 2  # header, buckets, depths, 2 lengths
    assert lines[-1].split()[:2] == ["length", "512"]


def test_the_eval_command_without_a_checkpoint_says_so(tmp_path) -> None:
    import yaml

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump(base_spec(**{"training.checkpoint.dir": str(tmp_path / "none")}))
    )
    done = subprocess.run(
        [CTXLAUNCH, "eval", str(spec_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 2
    assert "no checkpoint to evaluate" in done.stderr


def packed_corpus(path: Path) -> Path:
    """Documents of 20..300 ids below 256, each ending in 0 (end of document)."""
    import numpy as np

    from ctxlaunch.runtime.data.indexed import IndexedWriter, token_dtype

    rng = np.random.default_rng(5)
    with IndexedWriter(path, token_dtype(256)) as writer:
        for _ in range(60):
            writer.add_document(np.append(rng.integers(1, 256, rng.integers(20, 300)), 0))
        writer.commit()
    return path


@pytest.mark.timeout(300)
def test_document_masked_evaluation_scores_each_document_alone(tmp_path) -> None:
    """Under training.data.document_mask the held-out loss is each held-out document's own
    loss, run alone from position 0 (the targets that open the next document not counted),
    bucketed by the position in its document; CP 2 ring scores the same."""
    from ctxlaunch.runtime.evaluation.eval_data import held_out
    from ctxlaunch.runtime.modeling.model import Transformer

    prefix = packed_corpus(tmp_path / "docs")
    changes = {
        "training.data": {
            "source": "tokens",
            "path": str(prefix),
            "eval_fraction": 0.5,
            "document_mask": True,
        },
        "training.eval.passkey": {"enabled": False},
        "training.seq_len": 256,
        "training.eval.sequences": 2,
    }
    spec = validate_spec(base_spec(**changes))
    got = EvalResult.from_dict(
        run_distributed(evaluate_rank, 1, spec.model_dump(mode="json"), timeout_s=120)[0]
    )
    model = Transformer.from_spec(spec.model)
    model.init_weights(spec.training.seed)
    data = held_out(spec)
    assert data.document_ids is not None
    edges = bucket_edges(256, 3)
    sums = [0.0] * (len(edges) - 1)
    counts = [0] * (len(edges) - 1)
    with torch.no_grad():
        for sequence, ids in zip(data.sequences, data.document_ids, strict=True):
            starts = [0] + [i for i in range(1, 257) if ids[i] != ids[i - 1]] + [257]
            for start, stop in zip(starts, starts[1:], strict=False):
                piece = sequence[start:stop]
                if piece.numel() < 2:
                    continue
                hidden = model.hidden_states(piece[None, :-1], torch.arange(piece.numel() - 1))
                logits = torch.nn.functional.linear(hidden, model.head.weight)[0]
                losses = torch.nn.functional.cross_entropy(logits, piece[1:], reduction="none")
                for position, loss in enumerate(losses.tolist()):
                    if start + position >= 256:
                        break  # beyond the inputs: the window's last target
                    bucket = sum(position >= e for e in edges[1:-1])
                    sums[bucket] += loss
                    counts[bucket] += 1
    assert [b.tokens for b in got.buckets] == counts
    for bucket, total, count in zip(got.buckets, sums, counts, strict=True):
        assert bucket.loss == pytest.approx(total / count, rel=1e-5)
    assert "no passkey" not in (got.passkey_note or "") and got.passkey == []
    ring = EvalResult.from_dict(
        run_distributed(
            evaluate_rank,
            2,
            validate_spec(
                base_spec(**changes, **{"parallel.cp": 2, "cluster.gpus_per_node": 2})
            ).model_dump(mode="json"),
            timeout_s=180,
        )[0]
    )
    assert [b.tokens for b in ring.buckets] == counts
    for mine, theirs in zip(ring.buckets, got.buckets, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=1e-5)
