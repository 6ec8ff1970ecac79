"""Where one training step goes: the steps of ``train_speed.py`` (same models, same batch: 128 sentences x
30 + 30 random tokens, forward + loss + backward + Adam) split three ways.

- **Phases**, wall clock: forward + loss, backward, optimizer step (median over ``--rounds``).
- **Ops**, under ``torch.profiler`` (self CPU time per step): matrix products (``aten::mm`` / ``addmm`` / ``bmm``),
  attention kernels (``scaled_dot_product_*``), dropout masks (``aten::bernoulli_``: torch's CPU generator),
  dtype casts (``aten::copy_`` / ``_to_copy``, mostly autocast's), and the rest; plus the top ops by self time.
- **Rates of this CPU**: the matrix products' GFLOP/s within the step (the profiler's FLOP count of mm / addmm /
  bmm over their self time) against one large product of the same dtype alone, and the dropout masks' ns per
  element at 1 and at 2 threads (is torch's CPU random number generation parallel?).

    python benchmarks/train_profile.py --bf16      # -> benchmarks/results/train_profile_bf16_KIND.json
    python benchmarks/train_profile.py --rows soft marian --rounds 3
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from train_speed import (TRAINED, add_step_arguments, build_models, check_counts, forward_loss, output_path,
                         synthetic_batch)

from hf_hardattn.tools.training import machine

MATRIX = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
GROUPS = {
    "matrix products": lambda key: key in MATRIX,
    "attention kernels": lambda key: "scaled_dot_product" in key,
    "dropout masks": lambda key: key in ("aten::bernoulli_", "aten::uniform_"),
    "dtype casts": lambda key: key in ("aten::copy_", "aten::_to_copy"),
}


def phases(name, model, batch, bf16, rounds):
    """Median wall-clock seconds of forward + loss, backward and the optimizer step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = {"forward + loss": [], "backward": [], "optimizer": []}
    for round_ in range(rounds + 1):  # the first round warms up
        start = time.perf_counter()
        loss = forward_loss(name, model, batch, bf16)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        if round_:
            for key, value in zip(times, (forward - start, backward - forward, end - backward)):
                times[key].append(value)
    return {key: statistics.median(values) for key, values in times.items()}, optimizer


def op_profile(name, model, optimizer, batch, bf16, steps):
    """Self CPU seconds per step by op group and the top ops, and the matrix products' FLOP rate."""
    from torch.profiler import ProfilerActivity, profile

    def run(count, flops):
        with profile(activities=[ProfilerActivity.CPU], with_flops=flops) as prof:
            for _ in range(count):
                forward_loss(name, model, batch, bf16).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return prof.key_averages()

    # FLOP counting adds its own work to the ops' self times (measured: copy_ 2.7x), so it gets a step of
    # its own and the times come from a run without it
    flops = sum(e.flops for e in run(1, True) if e.key in MATRIX)
    events = run(steps, False)
    total = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    groups = {group: sum(e.self_cpu_time_total for e in events if test(e.key)) / 1e6 / steps
              for group, test in GROUPS.items()}
    groups["the rest"] = total - sum(groups.values())
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(total_s=total, groups_s=groups, matrix_gflops=flops / 1e9 / groups["matrix products"],
                matrix_gflop_per_step=flops / 1e9,
                top=[dict(op=e.key, s_per_step=e.self_cpu_time_total / 1e6 / steps, calls_per_step=e.count / steps)
                     for e in top])


def gemm_rate(dtype, rows=4096, inner=1024, cols=1024, repeats=5):
    """GFLOP/s of one large product [rows, inner] x [inner, cols] in ``dtype`` (best of ``repeats``)."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * rows * inner * cols / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rng_ns_per_element(threads, n=1 << 22, repeats=5):
    """ns per element of ``bernoulli_(0.9)`` (dropout's mask draw) on ``n`` floats at ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.empty(n)
    x.bernoulli_(0.9)
    best = min(_timed(lambda: x.bernoulli_(0.9)) for _ in range(repeats))
    torch.set_num_threads(before)
    return best / n * 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["soft", "marian"], choices=[row.name for row in TRAINED])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps for the phases (after one warm-up)")
    parser.add_argument("--profiled-steps", type=int, default=3)
    add_step_arguments(parser, "train_profile")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_counts(args, "rounds", "profiled_steps")
    args.output = output_path(args, "train_profile")
    torch.set_num_threads(args.threads)
    batch = synthetic_batch(args.batch, args.length)
    rows = {}
    for name, model in build_models(args.rows).items():
        timed, optimizer = phases(name, model, batch, args.bf16, args.rounds)
        rows[name] = dict(phases_s=timed, step_s=sum(timed.values()),
                          ops=op_profile(name, model, optimizer, batch, args.bf16, args.profiled_steps))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    rates = dict(gemm_gflops=gemm_rate(dtype), gemm_dtype=str(dtype),
                 bernoulli_ns_per_element={threads: rng_ns_per_element(threads) for threads in (1, 2)})

    lines = ["| row | step (s) | forward + loss | backward | optimizer | matrix products | attention kernels | "
             "dropout masks | dtype casts | the rest | matrix GFLOP/s |", "| --- |" + " ---: |" * 10]
    for name, row in rows.items():
        ops = row["ops"]
        share = {group: seconds / ops["total_s"] for group, seconds in ops["groups_s"].items()}
        lines.append(f"| {name} | {row['step_s']:.3f} | "
                     + " | ".join(f"{row['phases_s'][k]:.3f}" for k in row["phases_s"])
                     + " | " + " | ".join(f"{100 * share[g]:.0f}%" for g in ops["groups_s"])
                     + f" | {ops['matrix_gflops']:.0f} |")
    table = "\n".join(lines)
    print(table)
    print(f"one large {dtype} product alone: {rates['gemm_gflops']:.0f} GFLOP/s; bernoulli_ ns/element at 1 / 2 "
          f"threads: {rates['bernoulli_ns_per_element'][1]:.2f} / {rates['bernoulli_ns_per_element'][2]:.2f}")
    for name, row in rows.items():
        print(f"{name}, top ops (ms per step, calls): " + ", ".join(
            f"{t['op']} {1000 * t['s_per_step']:.0f} ({t['calls_per_step']:.0f})" for t in row["ops"]["top"][:8]))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(dict(machine=machine(), command="python benchmarks/train_profile.py " + " ".join(argv),
                       batch=args.batch, length=args.length, rounds=args.rounds, bf16=args.bf16, rows=rows,
                       rates=rates, table=table), handle, indent=1)


if __name__ == "__main__":
    main()
