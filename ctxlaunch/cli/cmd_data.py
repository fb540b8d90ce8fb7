"""`ctxlaunch data ...`: training data. `data prepare` tokenizes text into a Megatron indexed
dataset (PREFIX.bin + PREFIX.idx) that `training.data: {source: tokens, path: PREFIX}` trains
on, and that Megatron trains on too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ctxlaunch.cli.common import err, fail, out
from ctxlaunch.cli.extras import needs_extras
from ctxlaunch.contract import exitcodes
from ctxlaunch.contract.loader import SpecError, load_spec

if TYPE_CHECKING:
    import numpy.typing as npt

data = typer.Typer(
    name="data", help="Training data: tokenize text for source: tokens.", no_args_is_help=True
)


@data.command("prepare")
@needs_extras("data prepare")
def prepare_command(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help="Text files (.txt: one document per file) or JSON lines (.jsonl/.json: one "
            "document per line, its text in --json-field).",
            show_default=False,
        ),
    ],
    tokenizer: Annotated[
        Path,
        typer.Option(
            "--tokenizer",
            "-t",
            help="A Hugging Face tokenizer.json (or its directory), a "
            "SentencePiece .model or a tiktoken BPE file.",
            show_default=False,
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Output prefix: writes OUTPUT.bin and OUTPUT.idx.",
            show_default=False,
        ),
    ],
    json_field: Annotated[
        str, typer.Option(help="The JSON lines field holding the text.")
    ] = "text",
    workers: Annotated[int, typer.Option(min=1, help="Tokenizing processes.")] = 1,
    model_vocab: Annotated[
        int | None,
        typer.Option(min=1, help="The model's vocabulary: a tokenizer with more ids is refused."),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(
            help="A job spec whose model.vocab the tokenizer must fit (instead of --model-vocab)."
        ),
    ] = None,
    eod_token: Annotated[
        str | None,
        typer.Option(help="The end-of-document token, when not the tokenizer's own eos."),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help='Chat JSON lines ({"messages": [{"role", "content"}, ...]}): render each '
            "conversation with the tokenizer's own chat template (chat_template.jinja or "
            "tokenizer_config.json beside tokenizer.json) and write OUTPUT.lossmask beside the "
            "tokens, marking the --supervise roles' turns (training.data.loss_mask).",
        ),
    ] = False,
    supervise: Annotated[
        list[str] | None,
        typer.Option(
            "--supervise",
            help="With --chat: a role whose turns the loss counts (repeatable); default assistant.",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Machine-readable output: the files written, the counts, the lengths."
        ),
    ] = False,
) -> None:
    """Tokenize INPUT files into OUTPUT.bin / OUTPUT.idx (Megatron's indexed dataset),
    appending the end-of-document token to each document; with --chat, conversations through
    the tokenizer's chat template, with a loss mask beside them. Bad input exits 2, writing
    nothing."""
    # Imported here: numpy and the tokenizers would otherwise load for every command, and every
    # command's start-up counts (submit's latency is benchmarked).
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from ctxlaunch.runtime.data.chat import prepare_chat
    from ctxlaunch.runtime.data.prepare import PrepareError, prepare
    from ctxlaunch.runtime.data.tokenizers import TokenizerError

    if supervise and not chat:
        fail("--supervise names the roles of chat data: it needs --chat")
    if chat and (workers > 1 or eod_token is not None or json_field != "text"):
        fail(
            "--chat reads each line's messages in one process and ends each conversation with "
            "the template's own tokens: drop --workers, --eod-token and --json-field"
        )

    if spec is not None:
        try:
            vocab_from_spec = load_spec(spec).model.vocab
        except SpecError as exc:
            err.print(str(exc), markup=False)
            raise typer.Exit(exitcodes.BAD_INPUT) from None
        if model_vocab is not None and model_vocab != vocab_from_spec:
            fail(
                f"--model-vocab {model_vocab} disagrees with {spec}'s model.vocab "
                f"= {vocab_from_spec}; give one of them"
            )
        model_vocab = vocab_from_spec
    total_bytes = sum(p.stat().st_size for p in inputs if p.is_file())
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    from ctxlaunch.contract.fsutil import sigterm_interrupts

    try:
        # SIGTERM unwinds as Ctrl-C does: the writer removes its temporary files.
        with sigterm_interrupts(), progress:
            task = progress.add_task("tokenizing", total=total_bytes)
            if chat:
                result = prepare_chat(
                    inputs,
                    tokenizer,
                    output,
                    roles=supervise or ["assistant"],
                    model_vocab=model_vocab,
                    on_progress=lambda done: progress.update(task, completed=done),
                )
            else:
                result = prepare(
                    inputs,
                    tokenizer,
                    output,
                    json_field=json_field,
                    workers=workers,
                    model_vocab=model_vocab,
                    eod_token=eod_token,
                    on_progress=lambda done: progress.update(task, completed=done),
                )
    except (PrepareError, TokenizerError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail(f"-o {output}: interrupted; nothing was written", exitcodes.FAILED)
    if as_json:
        _print_json(result, output)
        return
    if result.loss_mask_path is not None:
        out.print(
            f"wrote {result.bin_path}, {result.idx_path} and {result.loss_mask_path}: "
            f"{result.documents} conversations, {result.tokens} tokens, "
            f"{result.supervised_tokens} supervised (vocab {result.vocab_size}) in "
            f"{result.seconds:.2f} s"
        )
        _print_lengths(output)
        return
    skipped = f", {result.empty_skipped} empty skipped" if result.empty_skipped else ""
    out.print(
        f"wrote {result.bin_path} and {result.idx_path}: {result.documents} documents"
        f"{skipped}, {result.tokens} tokens (vocab {result.vocab_size}, end of document "
        f"{result.eod_id}) in {result.seconds:.2f} s, "
        f"{result.tokens_per_second:,.0f} tokens/s"
    )
    _print_lengths(output)


def _print_json(result: Any, output: Path) -> None:
    """`data prepare --json`: what was written and the documents' lengths."""
    import dataclasses
    import json

    import numpy as np

    from ctxlaunch.perf.flops import token_weighted_document_tokens
    from ctxlaunch.runtime.data.indexed import IndexedDataset

    sizes = np.asarray(IndexedDataset(output).document_lengths(), dtype=np.int64)
    report = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result).items()
    }
    report["lengths"] = {
        "median": int(np.median(sizes)) if sizes.size else 0,
        "longest": int(sizes.max()) if sizes.size else 0,
        "token_weighted_mean": round(token_weighted_document_tokens(sizes.tolist())),
    }
    out.print_json(json.dumps(report))


def _bucket_label(limit: int) -> str:
    return f"<={limit >> 10}K" if limit >= 1024 else f"<={limit}"


def document_length_lines(lengths: npt.ArrayLike) -> list[str]:
    """What a dataset's document lengths mean for training at length: the median, the longest
    and the token-weighted mean (the `data.mean_document_tokens` the planner costs a document
    mask's attention and the ring's balance from), then the count of documents per power-of-two
    length, shortest first."""
    import numpy as np

    from ctxlaunch.perf.flops import token_weighted_document_tokens

    sizes = np.asarray(lengths, dtype=np.int64)
    weighted = token_weighted_document_tokens(sizes.tolist())
    limits = 2 ** np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64)
    limits = np.maximum(limits, 256)
    values, counts = np.unique(limits, return_counts=True)
    buckets = " | ".join(
        f"{_bucket_label(int(v))} {int(c):,}" for v, c in zip(values, counts, strict=True)
    )
    return [
        f"document lengths in tokens (end of document included): median "
        f"{int(np.median(sizes)):,}, longest {int(sizes.max()):,}, token-weighted mean "
        f"{round(weighted):,} (set data.mean_document_tokens: {round(weighted)} for the "
        "planner's document-mask cost)",
        f"documents by length: {buckets}",
    ]


def _print_lengths(output: Path) -> None:
    from ctxlaunch.runtime.data.indexed import IndexedDataset

    for line in document_length_lines(IndexedDataset(output).document_lengths()):
        out.print(line)
