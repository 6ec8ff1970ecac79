"""Training throughput of every variant against the soft Transformer of the same size.

The models are exactly those of the reproduction table (``hf_hardattn.tools.reproduce.ROWS``, preset ``cpu`` of
Multi30k: d_model 256, 3+3 layers, 4 heads, FFN 1024, vocab 8000, dropout 0.1; hybrids and the beam-joint RNN have a
3-layer encoder and a 1-layer GRU of 256); rows that only decode another row's model or train on other data (KD) are
the same architecture as a listed row and are left out. One training step = forward + loss (label smoothing 0.1) +
backward + Adam step on 128 sentences x 30 source + 30 target tokens (3840 target tokens, about the preset's
4k-token batches), random tokens, no padding. ``torch.set_num_threads(2)``; the models' steps alternate round by
round (load from other processes hits all alike); the median over rounds is reported as target tokens/s and as
time relative to soft (and, for the GRU-decoder models, to the soft-attention hybrid).

Targets: beam-joint <= 1.3x soft's step time, recurrent <= 1.5x.

    python benchmarks/train_speed.py                 # -> benchmarks/results/train_speed_KIND.json
    python benchmarks/train_speed.py --bf16          # bf16 autocast -> benchmarks/results/train_speed_bf16_KIND.json
    python benchmarks/train_speed.py --rounds 2 --rows soft marian recurrent_expand_1
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hf_hardattn.tools.recipes import PRESETS
from hf_hardattn.tools.reproduce import ROWS
from hf_hardattn.tools.training import machine
from machine_kind import default_output


class VocabOnly:
    """What the row builders read from a tokenizer: its size and special token ids."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self):
        return 8000


TRAINED = [row for row in ROWS if row.build is not None and not row.kd and "multi30k" in row.tasks]


def build_models(names):
    """The rows' models at the cpu preset's size, in training mode, each from seed 0."""
    ctx = dict(recipe=PRESETS["multi30k"]["cpu"], tokenizer=VocabOnly(), length_ratio=1.0)
    rows = {row.name: row for row in TRAINED}
    models = {}
    for name in names:
        torch.manual_seed(0)
        models[name] = rows[name].build(ctx).train()
    return models


def synthetic_batch(batch, length):
    """``batch`` sentences of ``length`` random source and target tokens (seed 0), no padding."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 8000, (batch, length), generator=generator)
    labels = torch.randint(4, 8000, (batch, length), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def forward_loss(name, model, batch, bf16):
    """The row's training loss on ``batch`` (label smoothing 0.1), under bf16 autocast if ``bf16``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if name == "marian":  # its own loss has no label smoothing; the Trainer's LabelSmoother adds it
            logits = model(**batch).logits
            return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                   label_smoothing=PRESETS["multi30k"]["cpu"].label_smoothing)
        return model(**batch).loss


def add_step_arguments(parser, script):
    """The options this script and ``train_profile.py`` share: the batch, threads, precision and output file."""
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as the Multi30k cpu recipe trains")
    parser.add_argument("--output", default=None, help=f"default benchmarks/results/{script}[_bf16]_KIND.json")


def check_counts(args, *flags):
    """Refuse a count below 1 with an error that names its flag: the shared batch, length and threads, and
    ``flags`` (the calling script's own counts)."""
    for flag in ("batch", "length", "threads") + flags:
        if getattr(args, flag) < 1:
            raise ValueError(f"`--{flag.replace('_', '-')}` must be >= 1, got {getattr(args, flag)}.")


def output_path(args, script):
    """``--output``, or benchmarks/results/{script}[_bf16]_KIND.json (KIND the CPU: benchmarks/machine_kind.py)."""
    if args.output is not None:
        return args.output
    return default_output(f"{script}_bf16" if args.bf16 else script)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=[row.name for row in TRAINED],
                        choices=[row.name for row in TRAINED])
    parser.add_argument("--rounds", type=int, default=5)
    add_step_arguments(parser, "train_speed")
    args = parser.parse_args(argv)
    check_counts(args, "rounds")
    args.output = output_path(args, "train_speed")
    torch.set_num_threads(args.threads)
    names = list(dict.fromkeys(["soft"] + args.rows))
    recipe = PRESETS["multi30k"]["cpu"]
    models = build_models(names)
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, m in models.items()}
    batch = synthetic_batch(args.batch, args.length)

    def step(name):
        start = time.perf_counter()
        loss = forward_loss(name, models[name], batch, args.bf16)
        optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[name].step()
        return time.perf_counter() - start

    times = {name: [] for name in models}
    for name in models:
        step(name)  # warm-up
    for round_ in range(args.rounds):
        for name in models:
            times[name].append(step(name))
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()),
              flush=True)
    tokens = args.batch * args.length
    soft = statistics.median(times["soft"])
    hybrid = statistics.median(times["hybrid_additive"]) if "hybrid_additive" in times else None
    results = []
    lines = ["| row | step (s) | target tokens/s | time x soft | time x hybrid_additive | parameters |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, values in times.items():
        median = statistics.median(values)
        gru = hybrid is not None and (name.startswith("hybrid") or name.startswith("beam_joint_rnn"))
        result = dict(row=name, step_s=round(median, 4), tokens_per_s=round(tokens / median, 1),
                      x_soft=round(median / soft, 3), x_hybrid=round(median / hybrid, 3) if gru else None,
                      params=sum(p.numel() for p in models[name].parameters()))
        results.append(result)
        lines.append(f"| {name} | {median:.3f} | {result['tokens_per_s']:.0f} | {result['x_soft']:.2f}x | "
                     + (f"{result['x_hybrid']:.2f}x" if gru else "") + f" | {result['params']:,} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(dict(machine=machine(), batch=args.batch, length=args.length, rounds=args.rounds,
                       threads=args.threads, bf16=args.bf16, dims=recipe.dims, rows=results, table=table),
                  handle, indent=1)


if __name__ == "__main__":
    main()
