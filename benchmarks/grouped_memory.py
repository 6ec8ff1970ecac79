"""Grouped memory on a trained model: the test set decoded as the reproduction table does it, with the beams of a
sentence reading one row of the encoder output (our default) and with transformers' expansion to one row per beam.

Reads models trained by ``benchmarks/reproduce.py``. For each, decodes Multi30k test_2016_flickr with beam 4,
batches of 64 sorted by length and max_new_tokens = 1.5 x source + 10 (``hf_hardattn.tools.training.translate``), on both
paths, alternating round by round; reports how many translations differ between the paths (expected: none), the
BLEU of each, and the time of a whole test-set decode (median over rounds) with the speed ratio grouped / expanded.
``--packed`` adds the same two paths after ``pack_linears()``.

    python benchmarks/grouped_memory.py soft hard_self_cross --folder outputs/reproduce/multi30k-cpu-bf16-3267steps

Writes benchmarks/results/grouped_memory_KIND.json (KIND: benchmarks/machine_kind.py), or ``--output``.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn.tools.data import multi30k
from hf_hardattn.tools.training import machine, translate
from decode_speed import expanded_memory
from trained_models import check_trained_args
from machine_kind import default_output


def variants(model, packed: bool) -> dict:
    """name -> model: the grouped (default) and expanded paths, and packed copies of both with ``packed``."""
    out = {"grouped": model, "expanded": expanded_memory(copy.deepcopy(model))}
    if packed:  # a deep copy keeps the expanded path's switch
        out.update({f"{name}_packed": copy.deepcopy(m).pack_linears() for name, m in list(out.items())})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="row names (folders under --folder/models)")
    parser.add_argument("--folder", default=os.path.join("outputs", "reproduce", "multi30k-cpu"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--packed", action="store_true", help="also both paths after pack_linears()")
    parser.add_argument("--output", default=default_output("grouped_memory"))
    args = parser.parse_args(argv)
    check_trained_args(parser, args, ("batch_size", "num_beams", "rounds", "threads"))
    test = multi30k("test_2016_flickr")
    sources, references = list(test["source"]), list(test["target"])
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.folder, "tokenizer"))
    results = {}
    for row in args.models:
        model = AutoModelForSeq2SeqLM.from_pretrained(os.path.join(args.folder, "models", row)).eval()
        paths = variants(model, args.packed)
        seconds, outputs = {name: [] for name in paths}, {}
        for _ in range(args.rounds):  # alternate, so that drift of the machine hits every path alike
            for name, m in paths.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    outputs[name] = translate(m, tokenizer, sources, num_beams=args.num_beams,
                                              batch_size=args.batch_size)
                seconds[name].append(time.perf_counter() - start)
        result = {}
        for name in paths:
            reference_path = "expanded_packed" if name.endswith("_packed") else "expanded"
            result[name] = dict(
                bleu=round(sacrebleu.corpus_bleu(outputs[name], [references]).score, 2),
                differing_translations=sum(a != b for a, b in zip(outputs[name], outputs[reference_path])),
                seconds=[round(s, 2) for s in seconds[name]],
                sentences_per_s=round(len(sources) / statistics.median(seconds[name]), 1),
            )
        for name in [n for n in paths if n.startswith("grouped")]:
            other = name.replace("grouped", "expanded")
            result[f"{name} / {other}"] = round(statistics.median(seconds[other]) / statistics.median(seconds[name]), 3)
        results[row] = result
        print(row, json.dumps(result), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        command = "python benchmarks/grouped_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump(dict(machine=machine(), command=command, folder=args.folder, threads=args.threads, results=results),
                  handle, indent=2)
    return results


if __name__ == "__main__":
    main()
