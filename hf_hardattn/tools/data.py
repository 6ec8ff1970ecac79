"""Data sets for the hf_hardattn tooling: parallel text files (Multi30k) and German noun inflection.

* :func:`load_parallel` reads a sentence-aligned pair of files ``{split}.{src}`` / ``{split}.{tgt}`` (or ``.gz``);
* :func:`multi30k` is ``load_parallel`` on the Multi30k En-De folder (``train``, ``val``, ``test_2016_flickr``);
* :func:`load_split` reads a user's split from one spec string (what ``hf-hardattn train --train/--validation/--test``
  take): a file prefix (``PREFIX.{src}`` / ``PREFIX.{tgt}``, fairseq's convention), a TSV file with a header, a JSON
  Lines file, or a ``datasets`` dataset (``hf:NAME[:CONFIG]:SPLIT``, or a folder saved by ``save_to_disk``), with
  named columns or transformers' ``{"translation": {src: ..., tgt: ...}}`` rows (run_translation.py's format);
* :func:`german_nouns` builds a small, offline character-level task from the ``german-nouns`` package (Wiktionary
  noun paradigms): inflect a lemma for a case and number.

Every loader returns ``datasets.Dataset`` objects with the string columns ``"source"`` and ``"target"``.
Tooling, not runtime code.
"""

from __future__ import annotations

import csv
import functools
import gzip
import json
import os
import random
import re

import datasets
from german_nouns.config import CSV_FILE_PATH  # the CSV behind german_nouns.lookup.Nouns

MULTI30K_ENV = "HF_HARDATTN_MULTI30K"
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")

# German noun inflection --------------------------------------------------------------------------------------------
CASES = {"nominativ": "nom", "genitiv": "gen", "dativ": "dat", "akkusativ": "acc"}
NUMBERS = {"singular": "sg", "plural": "pl"}
GENDERS = ("m", "f", "n")
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")  # letters, with inner hyphens ("Mund-zu-Mund-Beatmung")


def read_lines(path: str) -> list[str]:
    """The lines of a text file (``.gz`` read through gzip), without their line ends."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def _find(folder: str, split: str, lang: str) -> str | None:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def load_parallel(folder, split: str, src: str = "en", tgt: str = "de") -> datasets.Dataset:
    """The sentence pairs of ``{folder}/{split}.{src}`` and ``{split}.{tgt}`` (each optionally ``.gz``), one
    sentence per line, as a Dataset with columns "source" and "target"."""
    folder = os.fspath(folder)
    paths = {lang: _find(folder, split, lang) for lang in (src, tgt)}
    missing = [f"{split}.{lang}[.gz]" for lang, path in paths.items() if path is None]
    if missing:
        present = sorted(os.listdir(folder)) if os.path.isdir(folder) else "the folder does not exist"
        raise FileNotFoundError(f"load_parallel: missing {', '.join(missing)} in {folder!r} (found: {present}).")
    source, target = read_lines(paths[src]), read_lines(paths[tgt])
    if len(source) != len(target):
        raise ValueError(f"load_parallel: {paths[src]} has {len(source)} lines but {paths[tgt]} has {len(target)}; "
                         "the files must be sentence-aligned.")
    return datasets.Dataset.from_dict({"source": source, "target": target})


def _pairs_from_rows(rows, where, source_column, target_column, src, tgt):
    """(sources, targets) from dict rows: named columns, else columns named by the languages, else a "translation"
    dict keyed by the languages."""
    sources, targets = [], []
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {number} is a {type(row).__name__}, not an object with named columns.")
        if source_column or target_column or (src in row and tgt in row):
            pair = (row.get(source_column or src), row.get(target_column or tgt))
            names = (source_column or src, target_column or tgt)
        elif isinstance(row.get("translation"), dict):
            pair = (row["translation"].get(src), row["translation"].get(tgt))
            names = (f"translation.{src}", f"translation.{tgt}")
        else:
            raise ValueError(f"{where}: row {number} has neither the columns {src!r} / {tgt!r} (or --source-column / "
                             f"--target-column) nor a 'translation' object; its keys: {sorted(row)}.")
        for name, value in zip(names, pair):
            if not isinstance(value, str):
                raise ValueError(f"{where}: row {number} has no text in column {name!r} (got {value!r}).")
        sources.append(pair[0])
        targets.append(pair[1])
    return sources, targets


def load_split(spec: str, src: str, tgt: str, source_column: str | None = None, target_column: str | None = None,
               allow_empty: bool = False) -> datasets.Dataset:
    """One split of the user's data as a Dataset with columns "source" and "target", from ``spec``:

    * ``PREFIX``: the files ``PREFIX.{src}`` and ``PREFIX.{tgt}`` (each optionally ``.gz``), one sentence a line;
    * ``FILE.tsv[.gz]``: tab-separated with a header row; the columns ``source_column`` / ``target_column``
      (default: the columns named ``src`` / ``tgt``);
    * ``FILE.jsonl[.gz]``: one JSON object a line, with those columns or a ``"translation"`` object keyed by language;
    * ``hf:NAME[:CONFIG]:SPLIT``: ``datasets.load_dataset(NAME, CONFIG, split=SPLIT)`` (offline: a local path or the
      cache), same columns; a folder written by ``Dataset.save_to_disk`` loads too.

    Refused with the spec named: a spec that matches none of these, files of different lengths, a row without text,
    an empty sentence on either side (unless ``allow_empty``), no rows at all. Nothing is dropped or cut silently."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"the data spec must be a non-empty string, got {spec!r}.")
    lower = spec.lower()
    if lower.endswith((".tsv", ".tsv.gz")):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"{spec!r}: no such TSV file.")
        lines = read_lines(spec)
        reader = csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
        sources, targets = _pairs_from_rows(reader, spec, source_column, target_column, src, tgt)
    elif lower.endswith((".jsonl", ".jsonl.gz")):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"{spec!r}: no such JSON Lines file.")
        rows = []
        for number, line in enumerate(read_lines(spec), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{spec!r}: line {number} is not JSON ({error}).") from error
        sources, targets = _pairs_from_rows(rows, spec, source_column, target_column, src, tgt)
    elif spec.startswith("hf:") or os.path.isfile(os.path.join(spec, "dataset_info.json")):
        if spec.startswith("hf:"):
            parts = spec[3:].split(":")
            if len(parts) not in (2, 3) or not all(parts):
                raise ValueError(f"{spec!r}: a datasets spec is hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT.")
            name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), parts[-1]
            try:
                dataset = datasets.load_dataset(name, config, split=split)
            except Exception as error:  # datasets raises many kinds (offline, missing config, ...)
                raise ValueError(f"{spec!r}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed: "
                                 f"{' '.join(str(error).split())[:300]}") from error
        else:
            dataset = datasets.load_from_disk(spec)
        sources, targets = _pairs_from_rows(iter(dataset), spec, source_column, target_column, src, tgt)
    else:
        paths = {lang: next((p for p in (f"{spec}.{lang}", f"{spec}.{lang}.gz") if os.path.isfile(p)), None)
                 for lang in (src, tgt)}
        if None in paths.values():
            missing = [f"{spec}.{lang}[.gz]" for lang, path in paths.items() if path is None]
            raise FileNotFoundError(
                f"{spec!r} is not a data spec: no {', '.join(missing)}; allowed: PREFIX (PREFIX.{src} and "
                f"PREFIX.{tgt}, one sentence a line, .gz allowed), FILE.tsv, FILE.jsonl, hf:NAME[:CONFIG]:SPLIT, or a "
                f"save_to_disk folder.")
        sources, targets = read_lines(paths[src]), read_lines(paths[tgt])
        if len(sources) != len(targets):
            raise ValueError(f"{paths[src]} has {len(sources)} lines but {paths[tgt]} has {len(targets)}; the files "
                             f"must be sentence-aligned.")
    if not sources:
        raise ValueError(f"{spec!r} holds no sentence pairs.")
    if not allow_empty:
        for number, (source, target) in enumerate(zip(sources, targets), 1):
            if not source.strip() or not target.strip():
                side = "source" if not source.strip() else "target"
                raise ValueError(f"{spec!r}: pair {number} has an empty {side} sentence; remove it (empty pairs are "
                                 f"never dropped silently).")
    return datasets.Dataset.from_dict({"source": sources, "target": targets})


def default_multi30k_root() -> str:
    """$HF_HARDATTN_MULTI30K, else ``../shared/data/multi30k`` beside the repository root."""
    if os.environ.get(MULTI30K_ENV):
        return os.environ[MULTI30K_ENV]
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../hf_hardattn/tools/data.py
    return os.path.join(os.path.dirname(repo_root), "shared", "data", "multi30k")


def multi30k(split: str, root=None, src: str = "en", tgt: str = "de") -> datasets.Dataset:
    """Multi30k (En-De) ``split`` ("train", "val" or "test_2016_flickr") from ``root`` (default
    :func:`default_multi30k_root`), e.g. the files of https://github.com/multi30k/dataset (data/task1/raw)."""
    root = os.fspath(root) if root is not None else default_multi30k_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"multi30k: data folder {root!r} not found. Pass root=FOLDER (or set ${MULTI30K_ENV}) to a folder with "
            f"{{split}}.{src}[.gz] and {{split}}.{tgt}[.gz] for the splits {MULTI30K_SPLITS}."
        )
    return load_parallel(root, split, src, tgt)


@functools.lru_cache(maxsize=2)
def _noun_paradigms(gender: bool) -> tuple:
    """(lemma, gender, ((case, number, form), ...)) for every plain noun of the german-nouns package (parsed once
    per process)."""
    return tuple(_read_noun_paradigms(gender))


def _read_noun_paradigms(gender: bool):
    with open(CSV_FILE_PATH, encoding="utf-8") as handle:
        rows = csv.reader(handle)
        header = next(rows)
        column = {name: i for i, name in enumerate(header)}
        seen = set()
        for row in rows:
            lemma = row[column["lemma"]].strip()
            # plain nouns only: no names, toponyms, abbreviations, affixes, adjectival declension, phrases
            if row[column["pos"]] != "Substantiv" or not _WORD.fullmatch(lemma) or lemma in seen:
                continue
            seen.add(lemma)
            # a noun with several genders has them in "genus 1", "genus 2", ... and its forms in "... 1", "... 2";
            # we take the first reading
            genus = row[column["genus"]] or row[column["genus 1"]]
            cells = []
            for case in CASES:
                for number in NUMBERS:
                    name = f"{case} {number}"
                    form = (row[column[name]] or row[column[f"{name} 1"]]).strip()
                    if form and _WORD.fullmatch(form):  # skip empty cells and dialect / bracketed entries
                        cells.append((case, number, form))
            if cells:
                yield lemma, (genus if gender and genus in GENDERS else ""), tuple(cells)


def german_nouns(
    seed: int = 0,
    test_fraction: float = 0.05,
    validation_fraction: float = 0.05,
    max_examples: int | None = None,
    gender: bool = True,
) -> datasets.DatasetDict:
    """German noun inflection from the ``german-nouns`` package (Wiktionary), a character-level seq2seq task.

    Each example inflects one lemma for one case and number:

    * ``source``: the lemma, then tags: ``"Haus <n> <gen> <pl>"`` = lemma ``Haus``, neuter, genitive plural.
      Gender tag ``<m>``/``<f>``/``<n>`` (left out for plural-only nouns, or everywhere with ``gender=False``),
      case ``<nom>``/``<gen>``/``<dat>``/``<acc>``, number ``<sg>``/``<pl>``. A ``kind="char"`` tokenizer
      (:func:`hf_hardattn.tools.tokenization.train_tokenizer`) keeps every ``<...>`` tag as one token.
    * ``target``: the inflected form (``"Häuser"``); extra columns ``lemma``, ``tag`` (``"<gen> <pl>"``), ``gender``.

    Nouns: entries whose part of speech is exactly "Substantiv" (no names, toponyms, abbreviations, adjectival
    nouns) and whose lemma is letters with optional inner hyphens; one entry per lemma (the first; for several
    genders, the first reading); the main form of each of the 8 cells (the first variant where the dictionary lists
    several); empty cells and forms that are not a plain word (dialect notes, brackets) are skipped.

    The split is BY LEMMA: the lemmas are shuffled with ``random.Random(seed)`` and all forms of a lemma go to one
    split, so the test set measures inflecting unseen nouns. ``max_examples`` keeps the first lemmas of that
    shuffled order until that many examples (then cuts at exactly ``max_examples``), before splitting; the same
    arguments always give the same splits. About 89k lemmas, 660k examples in all.
    """
    for name, value in (("test_fraction", test_fraction), ("validation_fraction", validation_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
    if test_fraction + validation_fraction >= 1:
        raise ValueError(f"`test_fraction` + `validation_fraction` must be < 1, got {test_fraction + validation_fraction}.")
    if max_examples is not None and (not isinstance(max_examples, int) or max_examples < 1):
        raise ValueError(f"`max_examples` must be a positive integer or None, got {max_examples!r}.")

    paradigms = sorted(_noun_paradigms(gender))  # a new list, sorted: independent of the CSV order
    random.Random(seed).shuffle(paradigms)
    if max_examples is not None:
        kept, total = [], 0
        for lemma, genus, cells in paradigms:
            if total >= max_examples:
                break
            cells = cells[: max_examples - total]
            kept.append((lemma, genus, cells))
            total += len(cells)
        paradigms = kept
    n_test = round(len(paradigms) * test_fraction)
    n_val = round(len(paradigms) * validation_fraction)
    if max_examples is not None and (test_fraction and not n_test or validation_fraction and not n_val):
        raise ValueError(f"`max_examples`={max_examples} leaves no lemma for the test or validation split; use more.")
    parts = {"test": paradigms[:n_test], "validation": paradigms[n_test : n_test + n_val],
             "train": paradigms[n_test + n_val :]}

    def build(items):
        columns = {"source": [], "target": [], "lemma": [], "tag": [], "gender": []}
        for lemma, genus, cells in items:
            for case, number, form in cells:
                tag = f"<{CASES[case]}> <{NUMBERS[number]}>"
                columns["source"].append(f"{lemma} <{genus}> {tag}" if genus else f"{lemma} {tag}")
                columns["target"].append(form)
                columns["lemma"].append(lemma)
                columns["tag"].append(tag)
                columns["gender"].append(genus)
        return datasets.Dataset.from_dict(columns)

    return datasets.DatasetDict({name: build(parts[name]) for name in ("train", "validation", "test")})


__all__ = ["load_parallel", "load_split", "multi30k", "german_nouns", "default_multi30k_root", "read_lines", "CASES", "NUMBERS"]
