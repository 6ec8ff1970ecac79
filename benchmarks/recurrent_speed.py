"""Training and decoding speed of the nine recurrent cross-attention variants against the soft baseline.

Rosendahl et al. report 5.4-7.9x the baseline's training time (Table 2), because their decoder runs position by
position. Here only the recurrent part of each cross-attention step is sequential (see hf_hardattn/recurrent.py); the
target is <= 1.5x.

Sizes (all models, random weights): d_model 256, 3+3 layers, 4 heads, FFN 1024, vocab 8000, dropout 0.1. Training
step = forward + backward + Adam step on a batch of 64 sentences x 30 source + 30 target tokens (1920 target tokens,
3840 in all), no padding. Timings are interleaved (one step of every model per round) so that load from other
processes hits every model alike; the median over rounds is reported. ``--sequential`` adds the paper's scheme for
one variant: the whole decoder run one target position at a time through the cache, with gradients.

Decoding: 30 forced tokens (min_new_tokens = max_new_tokens), greedy and beam 4, batch 1 and 32, sentences/s via
``hf_hardattn.tools.training.decode_speed`` (median of repeats), same models in eval mode.

    python benchmarks/recurrent_speed.py                      # writes benchmarks/results/recurrent_speed_KIND.json
    python benchmarks/recurrent_speed.py --rounds 3 --no-decode   # quick look
"""

import argparse
import json
import os
import statistics
import time

import torch

from hf_hardattn import RecurrentConfig, RecurrentForConditionalGeneration, SoftTransformerConfig
from hf_hardattn import SoftTransformerForConditionalGeneration
from hf_hardattn.caches import CACHE_FIELD, HardAttnCache
from hf_hardattn.recurrent import RECURRENT_VARIANTS
from hf_hardattn.tools.training import decode_speed, machine
from machine_kind import default_output

DIMS = dict(vocab_size=8000, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def build(name):
    if name == "soft":
        return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS))
    return RecurrentForConditionalGeneration(RecurrentConfig(recurrent_variant=name, **DIMS))


def make_batch(batch, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DIMS["vocab_size"], (batch, length), generator=generator)
    labels = torch.randint(4, DIMS["vocab_size"], (batch, length), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def sequential_loss(model, batch):
    """The paper's scheme: the whole decoder runs one target position at a time (cache carries everything)."""
    labels = batch["labels"]
    decoder_ids = model.prepare_decoder_input_ids_from_labels(labels)
    encoder = model.model.encoder(batch["input_ids"], batch["attention_mask"])
    cache, logits = HardAttnCache(), []
    for t in range(decoder_ids.shape[1]):
        out = model(encoder_outputs=encoder, attention_mask=batch["attention_mask"],
                    decoder_input_ids=decoder_ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        logits.append(out.logits)
    return model.compute_loss(torch.cat(logits, 1), labels)


def train_step(model, optimizer, batch, sequential=False):
    start = time.perf_counter()
    loss = sequential_loss(model, batch) if sequential else model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(RECURRENT_VARIANTS), choices=list(RECURRENT_VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequential", default="expand_1", help="variant also timed with the paper's sequential "
                        "decoder ('' to skip)")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--output", default=default_output("recurrent_speed"))
    args = parser.parse_args()
    if args.sequential and args.sequential not in args.variants:
        parser.error(f"--sequential {args.sequential!r} must be one of --variants {args.variants} (or '' to skip)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    names = ["soft"] + args.variants
    models = {name: build(name).train() for name in names}
    optimizers = {name: torch.optim.Adam(models[name].parameters(), lr=1e-4) for name in names}
    batch = make_batch(args.batch, args.length)
    runs = [(name, False) for name in names]
    if args.sequential:
        runs.append((args.sequential, True))
    times = {run: [] for run in runs}
    for run in runs:  # warm-up
        train_step(models[run[0]], optimizers[run[0]], batch, run[1])
    for round_ in range(args.rounds):
        for run in runs:
            times[run].append(train_step(models[run[0]], optimizers[run[0]], batch, run[1]))
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n}{'(seq)' if s else ''} {times[(n, s)][-1]:.2f}s"
                                                               for n, s in runs), flush=True)
    base = statistics.median(times[("soft", False)])
    training = {}
    for name, sequential in runs:
        key = name + (" (sequential decoder)" if sequential else "")
        median = statistics.median(times[(name, sequential)])
        training[key] = dict(median_s=round(median, 4), ratio=round(median / base, 3),
                             times_s=[round(t, 4) for t in times[(name, sequential)]])

    decoding = {}
    if not args.no_decode:
        for batch_size in (1, 32):
            ids = make_batch(batch_size, args.length, seed=1)["input_ids"]
            for beams in (1, 4):
                mode = "greedy" if beams == 1 else "beam4"
                for name in names:
                    speed = decode_speed(models[name], ids, num_beams=beams, new_tokens=30,
                                         repeats=args.decode_repeats)
                    decoding.setdefault(f"{mode} batch {batch_size}", {})[name] = round(speed, 3)
                    print(f"decode {mode} batch {batch_size} {name}: {speed:.2f} sent/s", flush=True)

    lines = [f"Training step (fwd+bwd+Adam), d_model 256, 3+3 layers, 4 heads, FFN 1024, vocab 8000, batch "
             f"{args.batch}x{args.length}+{args.length} tokens, {args.threads} threads, median of {args.rounds}",
             "", "| model | step (s) | vs soft |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['median_s']:.3f} | {v['ratio']:.2f}x |" for k, v in training.items()]
    if decoding:
        settings = list(decoding)
        lines += ["", "Decoding, sentences/s (30 forced tokens; in brackets: relative to soft)", "",
                  "| model | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
        for name in names:
            cells = [f"{decoding[s][name]:.2f} ({decoding[s][name] / decoding[s]['soft']:.2f})" for s in settings]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(dict(machine=machine(), dims=DIMS, batch=args.batch, length=args.length, threads=args.threads,
                       rounds=args.rounds, training=training, decoding=decoding, table=table), handle, indent=1)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
