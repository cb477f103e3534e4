"""The offline corpus of python -m trainscale.train: the `.py` files of this Python's standard
library (sysconfig's "stdlib" path, site-packages and __pycache__ left out), read in sorted
order of their relative paths until `corpus_mb` megabytes, one document per file. A byte-level
BPE tokenizer (the `tokenizers` library, installed with transformers) is trained on it once;
the tokenizer and the token ids (documents joined by <|endoftext|>) are cached in the cache
directory under a name that carries the text's hash and the vocabulary size, so every run and
every --impl on the machine reads the same tokens."""
import hashlib
import os
import sysconfig

import torch

from .selection import cache_dir as default_cache_dir

END_OF_TEXT = "<|endoftext|>"


def corpus_documents(corpus_mb: float):
    """(relative path, text) of the standard library's .py files in sorted path order, up to
    corpus_mb megabytes of UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    docs, size, limit = [], 0, corpus_mb * 1e6
    for path in sorted(paths):
        if size >= limit:
            break
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        docs.append((path, text))
        size += len(text.encode("utf-8"))
    if not docs:
        raise SystemExit(f"--data corpus: no .py files under the standard library path {root}")
    return docs


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _build(vocab_size: int, corpus_mb: float, folder: str, verbose: bool):
    docs = corpus_documents(corpus_mb)
    digest = hashlib.sha256()
    for path, text in docs:
        digest.update(path.encode() + b"\0" + text.encode("utf-8", "replace") + b"\0")
    stem = os.path.join(folder, f"stdlib-{digest.hexdigest()[:16]}-v{vocab_size}")
    if os.path.exists(stem + ".pt"):
        return stem
    if verbose:
        print(f"trainscale.train: training a {vocab_size}-token BPE tokenizer on {len(docs)} standard-library files "
              f"({sum(len(t) for _, t in docs) / 1e6:.1f} M characters); cached in {folder}", flush=True)
    texts = [text for _, text in docs]
    tokenizer = train_tokenizer(texts, vocab_size)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids += encoding.ids + [eot]
    os.makedirs(folder, exist_ok=True)
    # Written under temporary names then renamed: a concurrent run never reads half a file.
    tmp = f"{stem}.{os.getpid()}.tmp"
    tokenizer.save(tmp + ".json")
    os.replace(tmp + ".json", stem + ".json")
    torch.save({"tokens": torch.tensor(ids, dtype=torch.int32), "vocab": tokenizer.get_vocab_size(),
                "files": len(docs)}, tmp + ".pt")
    os.replace(tmp + ".pt", stem + ".pt")
    return stem


def corpus_tokens(vocab_size: int, corpus_mb: float, cache_dir, d, verbose: bool):
    """(int32 token ids, the tokenizer's vocabulary size), built by rank 0 on first use."""
    if vocab_size < 257:
        raise SystemExit(f"--vocab-size: expected at least 257 (256 bytes and <|endoftext|>), got {vocab_size}")
    folder = cache_dir or default_cache_dir()
    if d.main:
        stem = _build(vocab_size, corpus_mb, folder, verbose)
    if d.world > 1:
        import torch.distributed as dist
        shared = [stem if d.main else None]
        dist.broadcast_object_list(shared, src=0)
        stem = shared[0]
    data = torch.load(stem + ".pt")
    return data["tokens"], data["vocab"]
