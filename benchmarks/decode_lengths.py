"""Why one trained model decodes the test set slower than another: output length or step cost?

Reads the models trained by ``benchmarks/reproduce.py`` and, for each, decodes the test set the way the reproduction
table does (sorted by length, batches of 64, beam 4, max_new_tokens = 1.5 x source + 10) and counts what free
decoding costs: decoder steps summed over the batches, mean output tokens, and sentences that run to the length
limit (they keep their whole batch decoding). Then it times the models with the output length forced (same
sentences, 30 new tokens), alternating round by round: the cost of a step alone, as a ratio to the first model.

    python benchmarks/decode_lengths.py soft hard_self_cross hc_all hybrid_dot
    python benchmarks/decode_lengths.py soft hard_self_cross --folder outputs/reproduce/multi30k-cpu --threads 2

Writes benchmarks/results/decode_lengths_KIND.json (KIND: benchmarks/machine_kind.py), or ``--output``.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn.tools.data import multi30k
from hf_hardattn.tools.training import default_max_new_tokens, length_sorted_batches, machine
from trained_models import check_trained_args
from machine_kind import default_output


@torch.no_grad()
def free_decoding(model, tokenizer, sources, batch_size, num_beams):
    steps, at_limit, output_tokens = 0, 0, []
    for _, batch in length_sorted_batches(tokenizer, sources, batch_size):
        limit = default_max_new_tokens(batch["input_ids"])
        generated = model.generate(**batch, num_beams=num_beams, do_sample=False, max_new_tokens=limit)
        new = generated[:, 1:]  # without the decoder start token
        steps += new.shape[1]
        output_tokens += (new != tokenizer.pad_token_id).sum(1).tolist()
        at_limit += int(((new[:, -1] != tokenizer.pad_token_id) & (new[:, -1] != tokenizer.eos_token_id)).sum())
    return dict(decoder_steps=steps, mean_output_tokens=round(statistics.mean(output_tokens), 2),
                sentences_at_length_limit=at_limit)


@torch.no_grad()
def forced_seconds(model, tokenizer, sources, batch_size, num_beams, new_tokens):
    start = time.perf_counter()
    for _, batch in length_sorted_batches(tokenizer, sources, batch_size):
        model.generate(**batch, num_beams=num_beams, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="row names (folders under --folder/models); the first is the "
                                                  "reference of the forced-length ratio")
    parser.add_argument("--folder", default=os.path.join("outputs", "reproduce", "multi30k-cpu"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--forced-sentences", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=default_output("decode_lengths"))
    args = parser.parse_args(argv)
    check_trained_args(parser, args, ("batch_size", "num_beams", "forced_sentences", "new_tokens", "rounds", "threads"))
    sources = list(multi30k("test_2016_flickr")["source"])
    models = {m: AutoModelForSeq2SeqLM.from_pretrained(os.path.join(args.folder, "models", m)).eval()
              for m in args.models}
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.folder, "tokenizer"))
    results = {m: free_decoding(model, tokenizer, sources, args.batch_size, args.num_beams)
               for m, model in models.items()}
    seconds = {m: [] for m in models}
    for _ in range(args.rounds):  # alternate, so that drift of the machine hits every model alike
        for m, model in models.items():
            seconds[m].append(forced_seconds(model, tokenizer, sources[: args.forced_sentences], args.batch_size,
                                             args.num_beams, args.new_tokens))
    reference = statistics.median(seconds[args.models[0]])
    for m in models:
        results[m].update(forced_seconds=[round(s, 2) for s in seconds[m]],
                          forced_speed_x_first=round(reference / statistics.median(seconds[m]), 3))
        print(m, results[m], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        command = "python benchmarks/decode_lengths.py " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump(dict(machine=machine(), command=command, folder=args.folder, threads=args.threads, results=results),
                  handle, indent=2)


if __name__ == "__main__":
    main()
