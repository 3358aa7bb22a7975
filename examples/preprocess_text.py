"""Text preprocessing with a producer pool: BPE tokenization, packing, DP x CP slices.

    python examples/preprocess_text.py --data /tmp/text-run --producers 2 --dp 2 --cp 2

What it does, end to end, with nothing downloaded:
1. Writes a corpus of synthetic documents (a seeded word grammar, so runs are repeatable)
   into ``<data>/corpus/shard-NNNN.txt``, one document per line.
2. Trains a byte-level BPE tokenizer on it with the ``tokenizers`` library and saves it
   to ``<data>/tokenizer.json``.
3. Runs ``batchweave.run_pool`` over the shard files: each worker tokenizes its shard's
   documents, appends an end-of-document token to each, packs the token stream into
   ``dp`` sequences of ``seq_len`` tokens with a ``doc_ids`` array marking document
   boundaries (loss masks and attention resets are built from it), and splits every
   sequence into ``cp`` equal chunks along the sequence axis (context parallelism).
   Slice ``(d, c)`` holds chunk ``c`` of sequence ``d``. One shard is one TGB.
4. Reads the namespace back as rank 0 would and prints a decoded sample.
"""

from __future__ import annotations

import argparse
import functools
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import batchweave as bw

END_OF_DOC = "<|endoftext|>"
_WORDS = (
    "the model reads every shard once and the ranks agree on each step while producers pack tokens "
    "into sequences of equal length gradients flow through layers of attention and data arrives "
    "from object storage without a coordinator checkpoints record cursors and training resumes"
).split()


def write_corpus(directory: Path, shards: int, docs_per_shard: int, seed: int = 0) -> list[Path]:
    """Synthetic documents, one per line: sentences drawn from a small seeded vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for shard in range(shards):
        docs = []
        for _ in range(docs_per_shard):
            sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(4, 14))) for _ in range(rng.randint(1, 6))]
            docs.append(". ".join(sentences).capitalize() + ".")
        path = directory / f"shard-{shard:04d}.txt"
        path.write_text("\n".join(docs) + "\n")
        paths.append(path)
    return paths


def train_tokenizer(corpus: list[Path], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE tokenizer trained on ``corpus`` (seconds on a few MB)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_DOC], show_progress=False)
    tokenizer.train([str(p) for p in corpus], trainer)
    tokenizer.save(str(out))
    return out


@functools.cache
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)  # once per worker process


def pack_shard(item: tuple[str, str, int, int, int]) -> list[dict[str, np.ndarray]]:
    """One shard file -> one TGB: ``dp`` packed sequences of ``seq_len`` tokens, CP-split.

    ``item`` is (shard path, tokenizer path, dp, cp, seq_len). Tokens past ``dp * seq_len``
    are dropped and a short shard is padded with end-of-document tokens (``doc_ids`` -1),
    so every TGB has the same shapes, as a training step needs.
    """
    shard_path, tokenizer_path, dp, cp, seq_len = item
    tokenizer = _tokenizer(tokenizer_path)
    eod = tokenizer.token_to_id(END_OF_DOC)
    tokens: list[int] = []
    doc_ids: list[int] = []
    for doc, text in enumerate(Path(shard_path).read_text().splitlines()):
        ids = [*tokenizer.encode(text).ids, eod]
        tokens.extend(ids)
        doc_ids.extend([doc] * len(ids))
    budget = dp * seq_len
    padding = max(0, budget - len(tokens))
    packed = np.array(tokens[:budget] + [eod] * padding, dtype=np.int32).reshape(dp, seq_len)
    docs = np.array(doc_ids[:budget] + [-1] * padding, dtype=np.int32).reshape(dp, seq_len)
    chunk = seq_len // cp
    return [
        {"tokens": packed[d, c * chunk : (c + 1) * chunk], "doc_ids": docs[d, c * chunk : (c + 1) * chunk]}
        for d in range(dp)
        for c in range(cp)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="working directory (corpus, tokenizer, namespace)")
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--docs-per-shard", type=int, default=40)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (a multiple of --cp)")
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.seq_len % args.cp:
        parser.error("--seq-len must be a multiple of --cp")

    corpus = write_corpus(args.data / "corpus", args.shards, args.docs_per_shard)
    tokenizer_path = train_tokenizer(corpus, args.vocab_size, args.data / "tokenizer.json")
    url = str(args.data / "namespace")
    source = [(str(p), str(tokenizer_path), args.dp, args.cp, args.seq_len) for p in corpus]
    report = bw.run_pool(
        url, "text", source, pack_shard, producers=args.producers, dp=args.dp, cp=args.cp, end_of_stream=True
    )
    print(f"committed {report.produced} TGBs from {len(corpus)} shards in {report.seconds:.1f} s")

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    with bw.Consumer(url, dp=args.dp, cp=args.cp, rank=0, timeout_s=30) as rank0:
        steps = list(rank0)
    first = steps[0].data
    print(
        f"rank 0 read {len(steps)} steps; slice shape {first['tokens'].shape}, documents in step 0: "
        f"{len(set(first['doc_ids'].tolist()) - {-1})}"
    )
    print("sample:", tokenizer.decode(first["tokens"][:40].tolist()))
    return 0 if len(steps) == args.shards else 1


if __name__ == "__main__":
    raise SystemExit(main())
