"""What int8 and bf16 decoding cost in translation quality (issue #44): trained models decoded in fp32, after
``model.quantize_int8()`` and after ``model.to(torch.bfloat16)``, on Multi30k test_2016_flickr the way the
reproduction table decodes (beam 4, batches of 64 sorted by length, max_new_tokens = 1.5 x source + 10).

Reads the models trained by ``benchmarks/reproduce.py`` (folders under ``--folder``/models) and its tokenizer; a
``MarianMTModel`` folder given with ``--marian`` (e.g. the source row of ``benchmarks/pretrained_hard.py``) is decoded
too, converted to a soft model (``hf_hardattn.convert``). Reports BLEU (sacrebleu), the share of sentences whose
output is identical to fp32's, and the test set's sentences/s (one free-decoding timing each: a rough figure; the
speed comparison is ``benchmarks/decode_speed.py``).

    python benchmarks/quantized_quality.py soft hybrid_additive_kd_eq1 --folder outputs/reproduce/multi30k-cpu
    python benchmarks/quantized_quality.py soft --precisions fp32 int8 --threads 1

bf16 runs only on CPUs with native bf16 matrix products unless named (elsewhere it is ~100x slower).
Writes benchmarks/results/quantized_quality.json, or ``--output``.
"""

import argparse
import json
import os
import sys
import time

import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn.data import multi30k
from hf_hardattn.training import cpu_has_bf16_matmul, machine, translate
from trained_models import check_trained_args

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PRECISIONS = ("fp32", "int8", "bf16")


def load(args, name):
    if name == "converted_marian":
        from transformers import MarianMTModel

        from hf_hardattn import convert

        return convert(MarianMTModel.from_pretrained(args.marian).eval(), "soft_transformer").eval()
    return AutoModelForSeq2SeqLM.from_pretrained(os.path.join(args.folder, "models", name)).eval()


def with_precision(model, precision):
    if precision == "int8":
        return model.quantize_int8()
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="row names (folders under --folder/models)")
    parser.add_argument("--folder", default=os.path.join("outputs", "reproduce", "multi30k-cpu"))
    parser.add_argument("--marian", help="a MarianMTModel folder, decoded converted to a soft model "
                                         "(its tokenizer: the folder's, else --folder's)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="default: all (bf16 only on CPUs with native bf16 matrix products)")
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-sentences", type=int, default=None, help="the first N test sentences (default all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=os.path.join(RESULTS, "quantized_quality.json"))
    args = parser.parse_args(argv)
    if not args.models and not args.marian:
        parser.error("name at least one trained row or --marian")
    if args.max_sentences is not None and args.max_sentences < 1:
        parser.error(f"--max-sentences must be >= 1, got {args.max_sentences}")
    if args.marian and not os.path.isdir(args.marian):
        parser.error(f"--marian {args.marian!r} is not a folder")
    check_trained_args(parser, args, ("num_beams", "batch_size", "threads"))
    precisions = args.precisions or [p for p in PRECISIONS if p != "bf16" or cpu_has_bf16_matmul()]
    test = multi30k("test_2016_flickr")
    sources, references = list(test["source"]), list(test["target"])
    if args.max_sentences:
        sources, references = sources[: args.max_sentences], references[: args.max_sentences]
    tokenizers = {}
    if args.models:
        tokenizers["rows"] = AutoTokenizer.from_pretrained(os.path.join(args.folder, "tokenizer"))
    if args.marian:
        has_own = os.path.exists(os.path.join(args.marian, "tokenizer_config.json"))
        tokenizers["converted_marian"] = AutoTokenizer.from_pretrained(args.marian if has_own else
                                                                       os.path.join(args.folder, "tokenizer"))
    names = list(args.models) + (["converted_marian"] if args.marian else [])
    results = {}
    for name in names:
        tokenizer = tokenizers.get(name, tokenizers.get("rows"))
        results[name], outputs = {}, {}
        for precision in precisions:
            model = with_precision(load(args, name), precision)
            start = time.perf_counter()
            hypotheses = translate(model, tokenizer, sources, num_beams=args.num_beams, batch_size=args.batch_size)
            seconds = time.perf_counter() - start
            outputs[precision] = hypotheses
            row = dict(bleu=round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
                       sentences_per_s=round(len(sources) / seconds, 1))
            if precision != "fp32" and "fp32" in outputs:
                row["identical_to_fp32"] = round(sum(a == b for a, b in zip(hypotheses, outputs["fp32"]))
                                                 / len(sources), 3)
                row["bleu_change"] = round(row["bleu"] - results[name]["fp32"]["bleu"], 2)
            results[name][precision] = row
            print(name, precision, row, flush=True)
    header = "| model | " + " | ".join(f"{p} BLEU" for p in precisions) + " | " + \
        " | ".join(f"{p} identical to fp32" for p in precisions if p != "fp32") + " |"
    lines = [header, "| --- |" + " ---: |" * (2 * len(precisions) - ("fp32" in precisions))]
    for name, rows in results.items():
        cells = [f"{rows[p]['bleu']:.2f}" + (f" ({rows[p]['bleu_change']:+.2f})" if "bleu_change" in rows[p] else "")
                 for p in precisions]
        cells += [f"{100 * rows[p].get('identical_to_fp32', float('nan')):.1f}%" for p in precisions if p != "fp32"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        command = "python benchmarks/quantized_quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump(dict(machine=machine(), command=command, folder=args.folder, threads=args.threads,
                       num_beams=args.num_beams, sentences=len(sources), results=results, table=table), handle, indent=2)
    return results


if __name__ == "__main__":
    main()
