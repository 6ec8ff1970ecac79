"""Decoding speed and training-step memory of hard-coded Gaussian attention (hc-sa, sh-x) against the soft baseline.

You et al. (2020), Sec. 5 / Table 3: sh-x decodes 1.30x and hc-sa 1.06x faster than base (GPU, batch 256), and fit
27% / 17% more tokens in a training batch.

Speed: Transformer-base dimensions (d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 8000), random weights,
exactly 30 output tokens (min_new_tokens = max_new_tokens), greedy and beam 4, batch 1 and 32, 2 CPU threads
(``--threads``; on a CPU shared with other jobs use 1: two OpenMP threads then mostly wait on each other).
The models are timed round-robin (one generate call each per round, after one untimed warm-up call) so that load
from other processes hits them alike; sentences/s = batch / median time over the rounds.

Memory: each model runs one training step (forward + backward of the label-smoothed loss, gradients allocated) on
a fixed batch in a fresh subprocess with glibc's mmap threshold pinned to 64 KiB (MALLOC_MMAP_THRESHOLD_), so every
tensor is its own mapping, returned to the OS on free, and the resident set tracks live tensors. Reported: the peak
resident set during the step minus the resident set just before it (``getrusage`` ru_maxrss vs /proc/self/statm),
after one untimed warm-up step (gradients then freed): activations, gradients and temporaries of that step, not
the weights (file-backed pages faulted back in during the step, after the shared machine reclaimed them, are
subtracted). Its inverse ratio to base is a proxy for the paper's "max tokens per batch".

    python benchmarks/gaussian_speed_memory.py [--rounds 5] [--threads 2] [--out benchmarks/results/gaussian_speed_memory.json]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

import torch

from hf_hardattn import GaussianConfig, GaussianForConditionalGeneration
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.training import decode_speed, machine

DIMS = dict(vocab_size=8000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
MODELS = ("base", "hc-sa", "sh-x")
PAPER_SPEEDUP = {"hc-sa": 28.4 / 26.8, "sh-x": 34.9 / 26.8}  # Table 3 (WMT16 En-Ro, sentences/s vs base)
PAPER_TOKENS = {"hc-sa": 10.8 / 9.2, "sh-x": 11.7 / 9.2}  # Table 3, max tokens per batch vs base


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "base":
        return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS)).eval()
    return GaussianForConditionalGeneration(GaussianConfig.preset(name, **DIMS)).eval()


def source(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DIMS["vocab_size"], (batch, length), generator=generator)
    ids[:, -1] = 2  # eos
    return ids


def speed(rounds: int, source_length: int):
    models = {name: build(name) for name in MODELS}
    rows = []
    for batch in (1, 32):
        ids = source(batch, source_length)
        for beams in (1, 4):
            times = {name: [] for name in MODELS}
            with torch.inference_mode():
                for name, model in models.items():  # warm-up
                    decode_speed(model, ids, num_beams=beams, new_tokens=30, repeats=1, warmup=0)
                for _ in range(rounds):
                    for name, model in models.items():
                        times[name].append(decode_speed(model, ids, num_beams=beams, new_tokens=30, repeats=1,
                                                        warmup=0))
            row = {"batch": batch, "num_beams": beams}
            for name in MODELS:
                row[name] = statistics.median(times[name])
            for name in MODELS[1:]:
                row[f"{name}/base"] = row[name] / row["base"]
            rows.append(row)
            print(f"  batch {batch:>2} beams {beams}: " + "  ".join(f"{n} {row[n]:7.2f}" for n in MODELS), flush=True)
    return rows


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
    parser.add_argument("--rounds", type=int, default=5, help="timed generate calls per model and setting")
    parser.add_argument("--source-length", type=int, default=20)
    parser.add_argument("--memory-batch", type=int, default=16)
    parser.add_argument("--memory-length", type=int, default=32, help="source and target tokens per sentence")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (use 1 on a CPU shared with other jobs: "
                        "2 OpenMP threads on a contended 2-core machine wait on each other)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "gaussian_speed_memory.json"))
    parser.add_argument("--memory-child", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child, args.memory_batch, args.memory_length, args.threads)
    torch.set_num_threads(args.threads)
    print(f"decoding speed (sentences/s, median of {args.rounds} rounds, 30 tokens, source length "
          f"{args.source_length}):", flush=True)
    rows = speed(args.rounds, args.source_length)
    mem = None if args.skip_memory else (print(
        f"training-step memory (batch {args.memory_batch} x {args.memory_length}+{args.memory_length} tokens):",
        flush=True) or memory(args.memory_batch, args.memory_length, args.threads))

    print("\n| batch | beams | base sent/s | hc-sa sent/s | sh-x sent/s | hc-sa/base | sh-x/base |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['num_beams']} | {r['base']:.2f} | {r['hc-sa']:.2f} | {r['sh-x']:.2f} | "
              f"{r['hc-sa/base']:.2f}x | {r['sh-x/base']:.2f}x |")
    print(f"| paper (GPU, batch 256) | | 26.8 | 28.4 | 34.9 | {PAPER_SPEEDUP['hc-sa']:.2f}x | "
          f"{PAPER_SPEEDUP['sh-x']:.2f}x |")
    if mem:
        print("\n| model | step peak MiB | of which gradients | base/model | paper tokens/batch vs base |")
        print("|---|---|---|---|---|")
        for name in MODELS:
            ratio = mem["base"]["step_peak_mib"] / mem[name]["step_peak_mib"]
            paper = f"{PAPER_TOKENS[name]:.2f}" if name in PAPER_TOKENS else "1.00"
            print(f"| {name} | {mem[name]['step_peak_mib']:.1f} | {mem[name]['gradients_mib']:.1f} | {ratio:.2f} | "
                  f"{paper} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "dims": DIMS, "rounds": args.rounds, "source_length": args.source_length,
                   "speed": rows, "memory": mem, "memory_batch": [args.memory_batch, args.memory_length],
                   "paper_speedup": PAPER_SPEEDUP,
                   "paper_tokens_ratio": PAPER_TOKENS}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
