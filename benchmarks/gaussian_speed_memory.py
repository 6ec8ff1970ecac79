"""Speed and memory of hard-coded Gaussian attention (hc-sa, hc-all, sh-x; implementations full, conv, index) against
the soft baseline, all in one run.

You et al. (2020), Sec. 5 / Table 3: sh-x decodes 1.30x and hc-sa 1.06x faster than base (GPU, batch 256), and fit
27% / 17% more tokens in a training batch. Sec. 6.3: conv (window 3) and index are the cheaper implementations
("a highly-efficient alternative": index needs no multiplication with a weight vector); the paper gives no figure
for them. Here conv and index combine W = window gathered value rows per query (index: 1), with no [Tq, Tk] matrix;
full multiplies a [Tq, Tk] weight matrix with the values, like soft.

Models (``--models``): ``base`` (soft), ``PRESET`` or ``PRESET/IMPLEMENTATION`` with PRESET in hc-sa, hc-all, sh-x
and IMPLEMENTATION in full (default), conv, index; hc-all uses length_ratio 1.0 (random weights, equal source and
target lengths). Transformer-base dimensions (d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 8000), random
weights, ``--threads`` torch threads (use 1 on a CPU shared with other jobs).

Activation memory (the paper's measure is the largest batch that fits; on a CPU we measure what that batch size is
inversely proportional to): one training step (forward + backward of the label-smoothed loss, gradients set to
None first) under torch.profiler(profile_memory=True), after an untimed warm-up step; the allocator's events are
summed in time order. Reported per model: ``saved`` = the bytes still live after the forward (the activations kept
for backward, the parameters excluded as they exist before), ``step_peak`` = the largest live total during forward
and backward (activations + temporaries + the gradients as they are allocated), ``gradients`` = parameter bytes.
``soft/model`` of ``saved`` is the batch that fits (for a fixed memory left after weights, gradients and the
optimizer state) relative to soft. Deterministic: other jobs on the machine do not change it.

Time (ratios vs soft measured in the same run, models round-robin, one call each per round after an untimed
warm-up, median over ``--rounds``): a training step (forward + backward) at each ``--memory-lengths``, and decoding
(greedy and beam 4, batch 1 and 32, exactly 30 tokens, source ``--source-length``).

    python benchmarks/gaussian_speed_memory.py [--rounds 5] [--threads 1] [--models base hc-sa hc-sa/conv ...]
        [--out benchmarks/results/gaussian_speed_memory_KIND.json]

Earlier (kept as a function, see benchmarks/README.md): ``memory(batch, length, threads)`` measured the resident-set
growth of a step in a fresh process; it includes allocator and library pages, and was not stable on a shared machine.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from hf_hardattn import GaussianConfig, GaussianForConditionalGeneration
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.tools.training import decode_speed, machine
from machine_kind import default_output

DIMS = dict(vocab_size=8000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
MODELS = ("base", "hc-sa", "sh-x")  # of the resident-set measure (memory_child)
ALL_MODELS = ("base", "hc-sa", "hc-sa/conv", "hc-sa/index", "hc-all", "hc-all/conv", "hc-all/index", "sh-x")
PAPER_SPEEDUP = {"hc-sa": 28.4 / 26.8, "sh-x": 34.9 / 26.8}  # Table 3 (WMT16 En-Ro, sentences/s vs base)
PAPER_TOKENS = {"hc-sa": 10.8 / 9.2, "sh-x": 11.7 / 9.2}  # Table 3, max tokens per batch vs base


def build(name: str, seed: int = 0, **overrides):
    """``base`` (soft) or ``PRESET[/IMPLEMENTATION]``; hc-all with length_ratio 1.0 (no corpus to fit it on)."""
    torch.manual_seed(seed)
    if name == "base":
        return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS, **overrides)).eval()
    preset, _, implementation = name.partition("/")
    fields = dict(DIMS, gaussian_implementation=implementation or "full", **overrides)
    if preset == "hc-all":
        fields["length_ratio"] = 1.0
    return GaussianForConditionalGeneration(GaussianConfig.preset(preset, **fields)).eval()


def source(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DIMS["vocab_size"], (batch, length), generator=generator)
    ids[:, -1] = 2  # eos
    return ids


def speed(rounds: int, source_length: int, names=MODELS):
    models = {name: build(name) for name in names}
    rows = []
    for batch in (1, 32):
        ids = source(batch, source_length)
        for beams in (1, 4):
            times = {name: [] for name in names}
            with torch.inference_mode():
                for name, model in models.items():  # warm-up
                    decode_speed(model, ids, num_beams=beams, new_tokens=30, repeats=1, warmup=0)
                for _ in range(rounds):
                    for name, model in models.items():
                        times[name].append(decode_speed(model, ids, num_beams=beams, new_tokens=30, repeats=1,
                                                        warmup=0))
            row = {"batch": batch, "num_beams": beams}
            for name in names:
                row[name] = statistics.median(times[name])
            for name in names[1:]:
                row[f"{name} vs base"] = row[name] / row["base"]
            rows.append(row)
            print(f"  batch {batch:>2} beams {beams}: " + "  ".join(f"{n} {row[n]:7.2f}" for n in names), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Activation memory (allocator events of torch.profiler) and training-step time
# ----------------------------------------------------------------------------------------------------------------
def batch_of(batch: int, length: int):
    ids, labels = source(batch, length, seed=1), source(batch, length, seed=2)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def live_bytes(events):
    """(peak, final) of the running total of allocator events [(time, bytes)]: counted from the start."""
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak, live


def profiled_allocations(fn):
    """[(time, bytes)] of every allocation (> 0) and free (< 0) on the CPU while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]


def activation_memory(name: str, batch: int, length: int, attention_dropout: float = 0.0):
    """{saved, step_peak, gradients} in MiB of one training step of ``name`` (see the module docstring): ``saved`` from
    a profiled forward (what is live at its end: the autograd graph's saved tensors, the logits and the loss), then
    ``step_peak`` from a profiled forward + backward with the same inputs and random state."""
    model = build(name, attention_dropout=attention_dropout).train()
    inputs = batch_of(batch, length)
    model(**inputs).loss.backward()  # warm-up: first-call allocations of kernels and thread pools, memoised weights
    model.zero_grad(set_to_none=True)
    kept = []
    torch.manual_seed(1)
    _, saved = live_bytes(profiled_allocations(lambda: kept.append(model(**inputs).loss)))
    kept.clear()
    torch.manual_seed(1)
    peak, _ = live_bytes(profiled_allocations(lambda: model(**inputs).loss.backward()))
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(saved_mib=saved / 2**20, step_peak_mib=peak / 2**20, gradients_mib=gradients / 2**20,
                parameters=sum(p.numel() for p in model.parameters()))


def train_step_time(names, batch: int, length: int, rounds: int):
    """Seconds of one training step (forward + backward), median over ``rounds`` round-robin rounds."""
    models = {name: build(name).train() for name in names}
    inputs = batch_of(batch, length)
    times = {name: [] for name in names}

    def step(model):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(**inputs).loss.backward()
        return time.perf_counter() - start

    for model in models.values():
        step(model)  # warm-up
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(step(model))
    return {name: statistics.median(t) for name, t in times.items()}


def rss_file() -> int:
    """File-backed resident bytes of this process (/proc/self/status RssFile)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def memory_child(name: str, batch: int, length: int, threads: int):
    torch.set_num_threads(threads)
    model = build(name).train()
    ids = source(batch, length, seed=1)
    labels = source(batch, length, seed=2)
    page = os.sysconf("SC_PAGE_SIZE")

    def step():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()

    step()  # warm-up: first-call allocations of the kernels and thread pools are not the model's
    model.zero_grad(set_to_none=True)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * page
    file_before = rss_file()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # library pages that the shared machine reclaimed and the step faulted back in are not the step's memory
    refaulted = max(rss_file() - file_before, 0)
    print("RESULT" + json.dumps({"step_peak_mib": (peak_after - before - refaulted) / 2**20,
                                 "refaulted_file_mib": refaulted / 2**20,
                                 "peak_grew": peak_after > peak_before,
                                 "process_peak_mib": peak_after / 2**20,
                                 "gradients_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                                 "parameters": sum(p.numel() for p in model.parameters())}))


def memory(batch: int, length: int, threads: int):
    results = {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for name in MODELS:
        command = [sys.executable, __file__, "--memory-child", name, "--memory-batch", str(batch), "--memory-length",
                   str(length), "--threads", str(threads)]
        proc = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results[name] = json.loads(proc.stdout.split("RESULT", 1)[1])
        print(f"  {name}: step peak {results[name]['step_peak_mib']:.1f} MiB, of which gradients "
              f"{results[name]['gradients_mib']:.1f} MiB (params {results[name]['parameters'] / 1e6:.1f}M)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(ALL_MODELS),
                        help="base (soft) first, then PRESET or PRESET/IMPLEMENTATION (e.g. hc-sa/conv)")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per model and setting")
    parser.add_argument("--source-length", type=int, default=20, help="source tokens of the decoding benchmark")
    parser.add_argument("--memory-batch", type=int, default=16, help="sentences of the training step")
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=[32, 128],
                        help="source and target tokens per sentence of the training step (one run per length)")
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="attention dropout of the memory measurement (the config default is 0)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-train-time", action="store_true")
    parser.add_argument("--skip-decoding", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (use 1 on a CPU shared with other jobs: "
                        "2 OpenMP threads on a contended 2-core machine wait on each other)")
    parser.add_argument("--out", default=default_output("gaussian_speed_memory"))
    parser.add_argument("--memory-child", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--memory-length", type=int, default=32, help=argparse.SUPPRESS)  # of --memory-child
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child, args.memory_batch, args.memory_length, args.threads)
    names = tuple(args.models)
    if names[0] != "base":
        raise ValueError(f"`--models` must start with base (the soft baseline every ratio is against), got {names}.")
    for name in names[1:]:
        preset, _, implementation = name.partition("/")
        if preset not in ("hc-sa", "hc-all", "sh-x") or implementation not in ("", "full", "conv", "index"):
            raise ValueError(f"`--models` entry {name!r}: allowed base, PRESET or PRESET/IMPLEMENTATION with PRESET in "
                             f"hc-sa, hc-all, sh-x and IMPLEMENTATION in full, conv, index.")
    torch.set_num_threads(args.threads)
    result = {"machine": machine(), "dims": DIMS, "models": names, "rounds": args.rounds,
              "paper_speedup": PAPER_SPEEDUP, "paper_tokens_ratio": PAPER_TOKENS}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every section, so that a run stopped early keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    if not args.skip_memory:
        result["activation_memory"] = {"batch": args.memory_batch, "attention_dropout": args.attention_dropout}
        for length in args.memory_lengths:
            mem = {name: activation_memory(name, args.memory_batch, length, args.attention_dropout) for name in names}
            result["activation_memory"][str(length)] = mem
            print(f"\nactivation memory, one training step, batch {args.memory_batch} x ({length}+{length}) tokens, "
                  f"attention_dropout {args.attention_dropout}:")
            print("| model | parameters | saved for backward MiB | soft/model (batch that fits) | step peak MiB | "
                  "gradients MiB | paper tokens/batch vs base |")
            print("|---|---|---|---|---|---|---|")
            for name in names:
                m = mem[name]
                paper = PAPER_TOKENS.get(name.removesuffix("/full"), "")
                print(f"| {name} | {m['parameters'] / 1e6:.1f}M | {m['saved_mib']:.1f} | "
                      f"{mem['base']['saved_mib'] / m['saved_mib']:.2f} | {m['step_peak_mib']:.1f} | "
                      f"{m['gradients_mib']:.1f} | {f'{paper:.2f}' if paper else ''} |", flush=True)
            save()

    if not args.skip_train_time:
        result["train_step_seconds"] = {"batch": args.memory_batch}
        for length in args.memory_lengths:
            seconds = train_step_time(names, args.memory_batch, length, args.rounds)
            result["train_step_seconds"][str(length)] = seconds
            print(f"\ntraining step (forward + backward), batch {args.memory_batch} x ({length}+{length}) tokens, "
                  f"median of {args.rounds}:")
            print("| model | seconds | speed vs base |")
            print("|---|---|---|")
            for name in names:
                print(f"| {name} | {seconds[name]:.3f} | {seconds['base'] / seconds[name]:.2f}x |", flush=True)
            save()

    if not args.skip_decoding:
        print(f"\ndecoding speed (sentences/s, median of {args.rounds} rounds, 30 tokens, source length "
              f"{args.source_length}):", flush=True)
        rows = speed(args.rounds, args.source_length, names)
        result["speed"], result["source_length"] = rows, args.source_length
        settings = [f"batch {r['batch']} beam {r['num_beams']}" for r in rows]
        print("\n| model | " + " | ".join(settings) + " |")
        print("|---|" + "---|" * len(rows))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{r[name]:.2f} ({r[name] / r['base']:.2f}x)" for r in rows) + " |")
        print(f"| paper (GPU, batch 256) | hc-sa {PAPER_SPEEDUP['hc-sa']:.2f}x, sh-x {PAPER_SPEEDUP['sh-x']:.2f}x |")

    save()
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
