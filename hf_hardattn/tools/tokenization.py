"""Joint (source + target) tokenizers for the hf_hardattn models, trained with the `tokenizers` library.

``train_tokenizer`` returns a ``PreTrainedTokenizerFast`` (transformers 5: ``TokenizersBackend``) with

* one vocabulary for both languages (the models tie source/target embeddings and the output layer);
* the special tokens ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` at ids 0, 1, 2, 3 (the ``HardAttnConfig`` defaults:
  pad 0, bos / decoder start 1, eos 2);
* a post-processor appending ``</s>`` to every encoded sequence, so ``tokenizer(text)`` and
  ``tokenizer(text_target=...)`` both end with eos, as the models expect;
* decoding that gives back the text: ``kind="bpe"`` is byte-level BPE (ByteLevel pre-tokenizer + decoder: every
  string round-trips, no ``<unk>``); ``kind="char"`` is one token per character, except that a tag written
  ``<word>`` (no spaces or angle brackets inside, e.g. ``<gen>``) is kept as ONE token (used by the German noun
  inflection task: ``"Haus <gen> <pl>"``). Characters not seen in training become ``<unk>``.

It saves with ``save_pretrained`` and reloads offline with ``AutoTokenizer.from_pretrained``.
Tooling, not runtime code: saved models do not need this file.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable, Iterator

import datasets
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2, 3
KINDS = ("bpe", "char")
# A char-level token: a whole tag "<word>" or one character (the tag alternative is tried first).
CHAR_PATTERN = r"<[^<>\s]+>|."


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")


def _iter_files(paths) -> Iterator[str]:
    for path in paths:
        with _open_text(path) as handle:
            for line in handle:
                line = line.rstrip("\n")
                if line:
                    yield line


def _is_file_list(value) -> bool:
    if isinstance(value, (str, os.PathLike)):
        return True
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, os.PathLike)) for v in value):
        return all(os.path.isfile(v) for v in value)
    return False


def iter_texts(texts_or_files, columns=("source", "target")) -> Iterator[str]:
    """The training text of ``train_tokenizer``: strings from an iterable of strings, from files (one sentence a
    line, ``.gz`` allowed: a path or a list of paths that all exist), or from the ``columns`` of a
    ``datasets.Dataset`` / ``DatasetDict`` (every split)."""
    if isinstance(texts_or_files, datasets.DatasetDict):
        for split in texts_or_files.values():
            yield from iter_texts(split, columns)
        return
    if isinstance(texts_or_files, datasets.Dataset):
        missing = [c for c in columns if c not in texts_or_files.column_names]
        if missing:
            raise ValueError(f"`columns` {missing} are not columns of the dataset; allowed: {texts_or_files.column_names}.")
        for column in columns:
            for text in texts_or_files[column]:
                if text:
                    yield text
        return
    if isinstance(texts_or_files, (str, os.PathLike)):
        if not os.path.isfile(texts_or_files):
            raise ValueError(f"`texts_or_files` is a single string but not an existing file: {texts_or_files!r}; "
                             "pass a list of strings to train on text.")
        yield from _iter_files([texts_or_files])
        return
    if _is_file_list(texts_or_files):
        yield from _iter_files(texts_or_files)
        return
    for text in texts_or_files:
        if not isinstance(text, str):
            raise ValueError(f"`texts_or_files` must hold strings or file paths, got an item of type {type(text).__name__}.")
        if text:
            yield text


def min_vocab_size(kind: str = "bpe", special_tokens: Iterable[str] = SPECIAL_TOKENS) -> int:
    """The smallest ``vocab_size`` :func:`train_tokenizer` can honour for ``kind``: ``"bpe"``, the special tokens and
    the 256 byte symbols that byte-level BPE always keeps (so that every string round-trips: 260 with the default
    special tokens; the ``tokenizers`` trainer returns that many entries for any smaller ``vocab_size``); ``"char"``,
    the special tokens and one character."""
    special_tokens = list(special_tokens)
    if kind == "bpe":
        return len(set(special_tokens) | set(pre_tokenizers.ByteLevel.alphabet()))
    return len(special_tokens) + 1


def train_tokenizer(
    texts_or_files,
    vocab_size: int = 8000,
    kind: str = "bpe",
    min_frequency: int = 2,
    special_tokens: Iterable[str] = SPECIAL_TOKENS,
    columns=("source", "target"),
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Train one joint vocabulary on ``texts_or_files`` (strings, file paths, or a Dataset with ``columns``).

    Args:
        vocab_size: BPE: the vocabulary size including special tokens, at least 260 (the special tokens and the
            256 bytes, see :func:`min_vocab_size`; a smaller one is refused). char: an upper bound (the most frequent
            symbols are kept), at least 5.
        kind: ``"bpe"`` (byte-level BPE) or ``"char"`` (characters, with ``<tag>`` tokens kept whole).
        min_frequency: symbols / merges seen fewer times are left out.
        special_tokens: the first four are pad, bos, eos, unk (ids 0-3); more may follow.
    """
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
    special_tokens = list(special_tokens)
    if len(special_tokens) < 4 or len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"`special_tokens` must list at least 4 distinct tokens (pad, bos, eos, unk), got {special_tokens!r}.")
    least = min_vocab_size(kind, special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < least:
        needs = (f"its {len(special_tokens)} special tokens and the 256 byte symbols that byte-level BPE always keeps"
                 if kind == "bpe" else f"its {len(special_tokens)} special tokens and one character")
        raise ValueError(f"`vocab_size` must be an integer >= {least} for kind={kind!r} ({needs}), got {vocab_size!r}.")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"`min_frequency` must be a positive integer, got {min_frequency!r}.")
    pad, bos, eos, unk = special_tokens[:4]
    texts = iter_texts(texts_or_files, columns)

    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        tok = Tokenizer(models.WordLevel(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_PATTERN), behavior="isolated")
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=special_tokens, show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)  # the "words" are the pre-tokenized characters / tags
        tok.decoder = decoders.Fuse()  # concatenate: the space character is a token of its own

    for i, token in enumerate(special_tokens[:4]):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token!r} got id {tok.token_to_id(token)}, expected {i}")
    eos_id = tok.token_to_id(eos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk,
        additional_special_tokens=special_tokens[4:] or None, clean_up_tokenization_spaces=False,
        model_max_length=model_max_length, padding_side="right",
    )


__all__ = ["train_tokenizer", "min_vocab_size", "iter_texts", "SPECIAL_TOKENS", "KINDS", "CHAR_PATTERN"]
