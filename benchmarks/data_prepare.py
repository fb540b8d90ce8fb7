"""`ctxlaunch data prepare` throughput against the tokenizer library's own raw throughput on the
same text, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/data_prepare.py [--megabytes 8] [--workers 2]

The corpus is this repository's Markdown, paragraphs as JSON-lines documents, repeated to
--megabytes. For each real tokenizer shipped in a package (Mistral 7B's SentencePiece model,
Llama 3's tiktoken BPE) it times: the library's own encode of every document in one process
(the physical limit of one core: prepare adds reading, JSON, the end-of-document id and the
writes), then `prepare` with 1 and with --workers processes. Megatron's
tools/preprocess_data.py is not timed: it cannot start on this machine (BENCHMARKS.md says why).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib.metadata import distribution
from pathlib import Path

from ctxlaunch.runtime.data.prepare import prepare
from ctxlaunch.runtime.data.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZERS = {
    "sentencepiece (Mistral 7B)": ("mistral_common", "mistral_common/data/tokenizer.model.v1"),
    "tiktoken (Llama 3)": ("llama_models", "llama_models/llama3/tokenizer.model"),
}


def corpus(path: Path, megabytes: float) -> list[str]:
    """Write the JSON-lines corpus to `path`; returns its documents."""
    paragraphs = [
        p
        for f in sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md"))
        for p in f.read_text(encoding="utf-8").split("\n\n")
        if p.strip()
    ]
    documents: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        for start in range(0, len(paragraphs), 8):
            documents.append("\n\n".join(paragraphs[start : start + 8]))
            size += len(documents[-1].encode())
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return documents


def main() -> None:
    """Print one row per tokenizer and method, and the JSON of all of them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "corpus.jsonl"
        documents = corpus(jsonl, args.megabytes)
        megabytes = jsonl.stat().st_size / 1e6
        print(f"corpus: {len(documents)} documents, {megabytes:.1f} MB of JSON lines")
        for name, (package, member) in TOKENIZERS.items():
            path = Path(str(distribution(package).locate_file(member)))
            tokenizer = load_tokenizer(path)
            started = time.perf_counter()
            raw_tokens = sum(len(tokenizer.encode(d)) for d in documents)
            raw_s = time.perf_counter() - started
            rows.append(
                {
                    "tokenizer": name,
                    "method": "library encode, 1 process",
                    "tokens": raw_tokens,
                    "seconds": raw_s,
                }
            )
            for workers in sorted({1, args.workers}):
                result = prepare([jsonl], path, Path(tmp) / f"out{workers}", workers=workers)
                rows.append(
                    {
                        "tokenizer": name,
                        "method": f"data prepare --workers {workers}",
                        "tokens": result.tokens,
                        "seconds": result.seconds,
                    }
                )
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["mb_per_s"] = megabytes / row["seconds"]
        print(
            f"{row['tokenizer']:28} {row['method']:28} {row['tokens']:>10} tokens "
            f"{row['seconds']:7.2f} s {row['tokens_per_s']:>12,.0f} tokens/s "
            f"{row['mb_per_s']:6.2f} MB/s"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
