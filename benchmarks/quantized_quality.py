"""What int8 and bf16 decoding cost in quality: models trained by ``benchmarks/reproduce.py`` decoded in
fp32, after ``model.quantize_int8()`` (each engine: fbgemm, onednn, traced) and after ``model.to(torch.bfloat16)``,
scored exactly as the reproduction table scores them (its stored task and recipe: Multi30k BLEU of beam 4 on test_2016_flickr, or noun-inflection exact
match; ``hf_hardattn.tools.reproduce.evaluate``).

Reads the rows' models (folders under ``--folder``/models), the folder's tokenizer and its
``reproduce_TASK_PRESET.json``; a ``MarianMTModel`` folder given with ``--marian`` (e.g. the source row of
``benchmarks/pretrained_hard.py``) is decoded too, converted to a soft model (``hf_hardattn.tools.convert``). Reports the
score, its change from fp32, the share of outputs identical to fp32's, and the test set's sentences/s (one
free-decoding timing each: a rough figure; the speed comparison is ``benchmarks/decode_speed.py``).

    python benchmarks/quantized_quality.py soft hybrid_additive_kd_eq1 --folder outputs/reproduce/multi30k-cpu
    python benchmarks/quantized_quality.py soft hc_sa --folder outputs/reproduce/nouns-cpu --precisions fp32 int8 int8_traced

bf16 runs only on CPUs with native bf16 matrix products unless named (elsewhere it is ~100x slower).
Writes benchmarks/results/quantized_quality_KIND.json (KIND: benchmarks/machine_kind.py), or ``--output``.
"""

import argparse
import glob
import json
import os
import sys

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn.tools.recipes import Recipe
from hf_hardattn.tools.reproduce import evaluate, load_task
from hf_hardattn.int8_traced import int_mm_is_exact
from hf_hardattn.tools.training import cpu_has_bf16_matmul, machine
from trained_models import check_trained_args
from machine_kind import default_output

# int8: quantize_int8()'s default engine (fbgemm); int8_onednn, int8_traced: its other engines (traced: the int8 layers that
# torch.compile traces, refused on CPUs whose int8 products saturate)
PRECISIONS = ("fp32", "int8", "int8_onednn", "int8_traced", "bf16")


def load(args, name):
    if name == "converted_marian":
        from transformers import MarianMTModel

        from hf_hardattn import convert

        return convert(MarianMTModel.from_pretrained(args.marian).eval(), "soft_transformer").eval()
    return AutoModelForSeq2SeqLM.from_pretrained(os.path.join(args.folder, "models", name)).eval()


def with_precision(model, precision):
    if precision.startswith("int8"):
        return model.quantize_int8(*precision.split("_")[1:])
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="row names (folders under --folder/models)")
    parser.add_argument("--folder", default=os.path.join("outputs", "reproduce", "multi30k-cpu"))
    parser.add_argument("--marian", help="a MarianMTModel folder, decoded converted to a soft model "
                                         "(its tokenizer: the folder's, else --folder's)")
    parser.add_argument("--data", help="the rows' Multi30k folder, if reproduce.py was given --data (default: "
                                        "../shared/data/multi30k)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="default: all (bf16 only on CPUs with native bf16 matrix products)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=default_output("quantized_quality"))
    args = parser.parse_args(argv)
    if not args.models and not args.marian:
        parser.error("name at least one trained row or --marian")
    if args.marian and not os.path.isdir(args.marian):
        parser.error(f"--marian {args.marian!r} is not a folder")
    check_trained_args(parser, args, ("threads",))
    stored = glob.glob(os.path.join(args.folder, "reproduce_*.json"))
    if len(stored) != 1:
        parser.error(f"--folder {args.folder!r} must hold one reproduce_TASK_PRESET.json, found {len(stored)}")
    with open(stored[0]) as handle:
        stored_table = json.load(handle)
    task, recipe = stored_table["task"], Recipe(**stored_table["recipe"])
    if args.marian and task != "multi30k":
        parser.error(f"--marian needs a multi30k folder (its tokenizer and test set), got task {task!r}")
    seeds = {row.get("seed", 0) for row in stored_table["rows"].values()} or {0}
    test = load_task(task, recipe, args.data, min(seeds))[1]
    precisions = args.precisions or [p for p in PRECISIONS if p != "bf16" or cpu_has_bf16_matmul()]
    if "int8_traced" in precisions and args.precisions is None and not int_mm_is_exact():
        precisions.remove("int8_traced")  # refused by quantize_int8 on this CPU (its int8 products saturate)
    rows_tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.folder, "tokenizer"))
    names = list(args.models) + (["converted_marian"] if args.marian else [])
    results = {}
    for name in names:
        tokenizer = rows_tokenizer
        if name == "converted_marian" and os.path.exists(os.path.join(args.marian, "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(args.marian)
        results[name], outputs = {}, {}
        for precision in precisions:
            model = with_precision(load(args, name), precision)
            scored = evaluate(task, model, tokenizer, test, recipe, return_hypotheses=True)
            outputs[precision] = scored["hypotheses"]
            row = dict(metric=scored["metric"], score=scored["score"], sentences_per_s=scored["sentences_per_s"])
            if precision != "fp32" and "fp32" in outputs:
                row["identical_to_fp32"] = round(sum(a == b for a, b in zip(outputs[precision], outputs["fp32"]))
                                                 / len(outputs["fp32"]), 3)
                row["score_change"] = round(row["score"] - results[name]["fp32"]["score"], 2)
            results[name][precision] = row
            print(name, precision, row, flush=True)
    metric = "BLEU" if task == "multi30k" else "exact match %"
    header = "| model | " + " | ".join(f"{p} {metric}" for p in precisions) + " | " + \
        " | ".join(f"{p} identical to fp32" for p in precisions if p != "fp32") + " |"
    lines = [header, "| --- |" + " ---: |" * (2 * len(precisions) - ("fp32" in precisions))]
    for name, rows in results.items():
        cells = [f"{rows[p]['score']:.2f}" + (f" ({rows[p]['score_change']:+.2f})" if "score_change" in rows[p] else "")
                 for p in precisions]
        cells += [f"{100 * rows[p].get('identical_to_fp32', float('nan')):.1f}%" for p in precisions if p != "fp32"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        command = "python benchmarks/quantized_quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
        trained = {name: dict({key: stored_table["rows"][name].get(key) for key in ("steps", "seed", "machine", "command")},
                              bf16=recipe.bf16)  # how the scored rows were trained (bf16: the recipe's mixed precision)
                   for name in args.models if name in stored_table["rows"]}
        json.dump(dict(machine=machine(), command=command, folder=args.folder, task=task, threads=args.threads,
                       num_beams=recipe.num_beams, examples=len(test), trained=trained, results=results, table=table),
                  handle, indent=2)
    return results


if __name__ == "__main__":
    main()
