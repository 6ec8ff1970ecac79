"""hf_hardattn.tools.data.load_split: every data format a user brings gives the same pairs as reading the files by hand,
and every malformed input is refused naming the spec (nothing dropped or cut)."""

import gzip
import json

import datasets
import pytest

from hf_hardattn.tools.data import load_split

PAIRS = [("A dog runs.", "Ein Hund läuft."), ("Two men\tsit.", "Zwei Männer sitzen."), ("Hi", "Hallo")]
TSV_PAIRS = [(s.replace("\t", " "), t) for s, t in PAIRS]  # a TSV field cannot hold a tab


def as_pairs(dataset):
    assert dataset.column_names == ["source", "target"]
    return list(zip(dataset["source"], dataset["target"]))


@pytest.mark.parametrize("gz", [False, True])
def test_prefix_files(tmp_path, gz):
    for index, lang in enumerate(("en", "de")):
        text = "".join(pair[index] + "\n" for pair in PAIRS)
        if gz:
            with gzip.open(tmp_path / f"train.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.write(text)
        else:
            (tmp_path / f"train.{lang}").write_text(text, encoding="utf-8")
    assert as_pairs(load_split(str(tmp_path / "train"), "en", "de")) == PAIRS
    assert as_pairs(load_split(str(tmp_path / "train"), "de", "en")) == [(t, s) for s, t in PAIRS]  # direction


def test_tsv_with_header_and_named_columns(tmp_path):
    lines = ["id\tenglish\tgerman"] + [f"{i}\t{s}\t{t}" for i, (s, t) in enumerate(TSV_PAIRS)]
    path = tmp_path / "data.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got = load_split(str(path), "en", "de", source_column="english", target_column="german")
    assert as_pairs(got) == TSV_PAIRS
    plain = tmp_path / "plain.tsv"
    plain.write_text("en\tde\n" + "".join(f"{s}\t{t}\n" for s, t in TSV_PAIRS), encoding="utf-8")
    assert as_pairs(load_split(str(plain), "en", "de")) == TSV_PAIRS  # columns named by the languages
    with pytest.raises(ValueError, match=r"row 1 has no text in column 'english'"):
        load_split(str(plain), "en", "de", source_column="english", target_column="de")


def test_jsonl_columns_and_translation_objects(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for s, t in PAIRS:
            handle.write(json.dumps({"translation": {"en": s, "de": t}}) + "\n")
    assert as_pairs(load_split(str(path), "en", "de")) == PAIRS
    named = tmp_path / "named.jsonl"
    named.write_text("".join(json.dumps({"src": s, "tgt": t, "x": 1}) + "\n" for s, t in PAIRS), encoding="utf-8")
    assert as_pairs(load_split(str(named), "en", "de", source_column="src", target_column="tgt")) == PAIRS
    with pytest.raises(ValueError, match=r"neither the columns 'en' / 'de'.*keys: \['src', 'tgt', 'x'\]"):
        load_split(str(named), "en", "de")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"en": "a", "de": "b"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 is not JSON"):
        load_split(str(broken), "en", "de")


def test_datasets_specs(tmp_path):
    rows = {"translation": [{"en": s, "de": t} for s, t in PAIRS]}
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    assert as_pairs(load_split(str(folder), "en", "de")) == PAIRS
    local = tmp_path / "local"
    local.mkdir()
    (local / "train.jsonl").write_text("".join(json.dumps({"en": s, "de": t}) + "\n" for s, t in PAIRS),
                                       encoding="utf-8")
    assert as_pairs(load_split(f"hf:{local}:train", "en", "de")) == PAIRS
    with pytest.raises(ValueError, match=r"hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT"):
        load_split("hf:onlyname", "en", "de")
    with pytest.raises(ValueError, match=r"load_dataset\(.*failed"):
        load_split(f"hf:{tmp_path / 'nothing-here'}:train", "en", "de")


def test_refused_inputs_name_the_spec(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"a.en has 2 lines but .*a.de has 1"):
        load_split(str(tmp_path / "a"), "en", "de")
    with pytest.raises(FileNotFoundError, match=r"no .*b.de\[.gz\]; allowed: PREFIX"):
        (tmp_path / "b.en").write_text("x\n", encoding="utf-8")
        load_split(str(tmp_path / "b"), "en", "de")
    (tmp_path / "c.en").write_text("one\n\nthree\n", encoding="utf-8")
    (tmp_path / "c.de").write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pair 2 has an empty source sentence"):
        load_split(str(tmp_path / "c"), "en", "de")
    assert len(load_split(str(tmp_path / "c"), "en", "de", allow_empty=True)) == 3
    (tmp_path / "e.en").write_text("", encoding="utf-8")
    (tmp_path / "e.de").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds no sentence pairs"):
        load_split(str(tmp_path / "e"), "en", "de")
    with pytest.raises(FileNotFoundError, match=r"no such TSV file"):
        load_split(str(tmp_path / "none.tsv"), "en", "de")
    with pytest.raises(ValueError, match=r"non-empty string"):
        load_split("", "en", "de")
