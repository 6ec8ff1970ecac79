"""Seeds, sets and standard errors of reproduce rows: which verdicts hold on every scored set.

Reads the ``reproduce_TASK_PRESET.json`` files of ``benchmarks/reproduce.py`` runs (one row per seed, each its own
folder or not), groups rows by (row name, initialisation) and prints, for every scored set (Multi30k:
``test_2016_flickr`` and ``val``, BLEU and chrF; nouns: exact match), the mean over seeds with its standard error, and
each comparison's paired difference (same seed, same set) with its standard error. A parity claim ("within 0.5 BLEU")
is called parity only when the mean difference is within the margin on every set.

    python benchmarks/compare_rows.py benchmarks/results/init_h200/*/reproduce_*.json \
        --compare hard_cross:soft hc_sa:soft --compare-init soft hard_cross --margin 0.5 \
        --output benchmarks/results/init_h200/summary.json

``--compare A:B`` pairs row A with row B of the same initialisation (``A@INIT:B@INIT`` names each side's
initialisation, e.g. ``"soft@xavier, emb N(0,0.02):marian@N(0,0.02)"``); ``--compare-init ROW`` pairs every other
initialisation of ROW (init_std, embed_init_std) against ROW with Xavier. The standard error of a mean of n values is sd / sqrt(n) (sample sd,
n - 1); with one seed it is not defined (shown as "n=1").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys


def init_name(init_std, embed_init_std=None) -> str:
    """"xavier" (the earlier default, before the embeddings-only init), "N(0,0.02)" (every weight), "xavier, emb
    N(0,0.02)" (Xavier linears, embeddings N(0, 0.02)); a named scheme by its name ("lipschitz")."""
    name = "xavier" if init_std is None else init_std if isinstance(init_std, str) else f"N(0,{init_std:g})"
    return name if embed_init_std is None else f"{name}, emb N(0,{embed_init_std:g})"


def row_init(row) -> str:
    return init_name(row.get("init_std"), row.get("embed_init_std"))


def load_rows(paths) -> list[dict]:
    """Every row of every file, with its file's task."""
    rows = []
    for path in paths:
        with open(path) as handle:
            payload = json.load(handle)
        for row in payload["rows"].values():
            rows.append(dict(row, task=payload["task"], file=path))
    return rows


def scores_of(row) -> dict:
    """{(metric, set): value}: Multi30k rows' BLEU and chrF per set; a row without sets gives its one score under its
    test set: "test_2016_flickr" for an older Multi30k row (its ``score``, the table's set), "test" for nouns."""
    if "scores" not in row:
        return {(row["metric"], "test_2016_flickr" if row.get("task") == "multi30k" else "test"): row["score"]}
    out = {("BLEU", name): value for name, value in row["scores"].items()}
    out.update({("chrF", name): value for name, value in row.get("chrf", {}).items()})
    return out


def mean_se(values) -> tuple[float, float | None]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def group(rows) -> dict:
    """{(row, init name): {seed: {(metric, set): value}}}; the same row, init and seed twice is an error."""
    groups = {}
    for row in rows:
        seeds = groups.setdefault((row["row"], row_init(row)), {})
        if row["seed"] in seeds:
            raise ValueError(f"row {row['row']} ({row_init(row)}) seed {row['seed']} appears twice "
                             f"({row['file']}); pass each run once.")
        seeds[row["seed"]] = scores_of(row)
    return groups


def differences(first: dict, second: dict) -> dict:
    """{(metric, set): {seed: first - second}} over the seeds both groups have and the scores every such seed has
    (benchmarks/tables.py's verdicts read these, unrounded)."""
    seeds = sorted(set(first) & set(second))
    keys = sorted(set.intersection(*(set(first[s]) & set(second[s]) for s in seeds))) if seeds else ()
    return {key: {s: first[s][key] - second[s][key] for s in seeds} for key in keys}


def paired(first: dict, second: dict, margin: float | None) -> dict:
    """Paired differences first - second over the seeds both have, per (metric, set)."""
    out = {}
    for key, per_seed in differences(first, second).items():
        seeds, diffs = sorted(per_seed), [per_seed[s] for s in sorted(per_seed)]
        mean, se = mean_se(diffs)
        out[key] = dict(seeds=seeds, differences=[round(d, 2) for d in diffs], mean=round(mean, 3),
                        se=None if se is None else round(se, 3))
        if margin is not None:
            out[key]["within_margin"] = abs(mean) <= margin
    return out


def summarise(rows, compare=(), compare_init=(), margin=None) -> dict:
    groups = group(rows)
    summary = dict(groups={}, comparisons={}, margin=margin)
    for (name, init), seeds in sorted(groups.items()):
        keys = sorted(set.intersection(*(set(v) for v in seeds.values())))
        summary["groups"][f"{name} [{init}]"] = {
            f"{metric} {split}": dict(seeds=sorted(seeds), values=[seeds[s][(metric, split)] for s in sorted(seeds)],
                                      mean=round(mean_se([seeds[s][(metric, split)] for s in sorted(seeds)])[0], 3),
                                      se=(lambda se: None if se is None else round(se, 3))(
                                          mean_se([seeds[s][(metric, split)] for s in sorted(seeds)])[1]))
            for metric, split in keys}
    pairs = []
    for spec in compare:
        a, b = spec.split(":")
        if "@" in a or "@" in b:  # ROW@INIT: one named initialisation on each side (e.g. soft's against marian's own)
            (a, a_init), (b, b_init) = (side.split("@", 1) if "@" in side else (side, "xavier") for side in (a, b))
            pairs.append(((a, a_init), (b, b_init)))
            continue
        inits = sorted({init for (name, init) in groups if name == a} & {init for (name, init) in groups if name == b})
        pairs += [((a, init), (b, init)) for init in inits]
    for name in compare_init:
        inits = sorted(init for (row, init) in groups if row == name and init != "xavier")
        pairs += [((name, init), (name, "xavier")) for init in inits if (name, "xavier") in groups]
    for first, second in pairs:
        if first not in groups or second not in groups:
            raise ValueError(f"nothing to compare: {first} or {second} is not among the rows read.")
        result = paired(groups[first], groups[second], margin)
        label = f"{first[0]} [{first[1]}] - {second[0]} [{second[1]}]"
        summary["comparisons"][label] = {f"{m} {s}": v for (m, s), v in result.items()}
        if margin is not None:
            bleu = [v["within_margin"] for (m, s), v in result.items() if m != "chrF"]
            summary["comparisons"][label]["parity_on_every_set"] = bool(bleu) and all(bleu)
    return summary


def markdown(summary) -> str:
    lines = ["| row [init] | score | seeds | values | mean | SE |", "| --- | --- | --- | --- | ---: | ---: |"]
    for label, scores in summary["groups"].items():
        for key, v in scores.items():
            se = "n=1" if v["se"] is None else f"{v['se']:.2f}"
            lines.append(f"| {label} | {key} | {v['seeds']} | {v['values']} | {v['mean']:.2f} | {se} |")
    lines += ["", f"| comparison (paired by seed) | score | differences | mean | SE |"
                  f"{' within ' + format(summary['margin'], 'g') + ' |' if summary['margin'] is not None else ''}",
              f"| --- | --- | --- | ---: | ---: |{' --- |' if summary['margin'] is not None else ''}"]
    for label, scores in summary["comparisons"].items():
        for key, v in scores.items():
            if key == "parity_on_every_set":
                continue
            se = "n=1" if v["se"] is None else f"{v['se']:.2f}"
            within = f" {'yes' if v['within_margin'] else 'no'} |" if "within_margin" in v else ""
            lines.append(f"| {label} | {key} | {v['differences']} | {v['mean']:+.2f} | {se} |{within}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="reproduce_TASK_PRESET.json files")
    parser.add_argument("--compare", nargs="*", default=[], metavar="A:B", help="paired differences of row A - row B (A@INIT:B@INIT: named initialisations)")
    parser.add_argument("--compare-init", nargs="*", default=[], metavar="ROW",
                        help="paired differences of ROW with another init - ROW with Xavier")
    parser.add_argument("--margin", type=float, default=None, help="parity margin (e.g. 0.5 BLEU)")
    parser.add_argument("--output", default=None, help="write the summary JSON (and .md beside it)")
    parser.add_argument("--rows", nargs="*", default=None, metavar="ROW",
                        help="read only these rows of the files (e.g. a few rows of an older run beside new ones)")
    args = parser.parse_args(argv)
    rows = [row for row in load_rows(args.files) if args.rows is None or row["row"] in args.rows]
    summary = summarise(rows, args.compare, args.compare_init, args.margin)
    table = markdown(summary)
    print(table)
    if args.output:
        summary["files"] = sorted(args.files)
        summary["command"] = "python benchmarks/compare_rows.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.output, "w") as handle:
            json.dump(summary, handle, indent=1)
        with open(args.output.rsplit(".", 1)[0] + ".md", "w") as handle:
            handle.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
