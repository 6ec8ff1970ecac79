"""Beam-joint attention (Shankar et al., 2018): training-step overhead against the soft model of equal size, and the
script path of the quality comparison.

speed (default)
    The paper reports 20-30% more training time than soft attention at K=6; our target is <= 1.3x. Two settings,
    each against its own soft model (same parameters, same batch):
      * setting 1, the paper's: Transformer encoder + RNN decoder with beam-joint output (beam_joint_rnn's defaults:
        the paper's Luong-style LSTM decoder with input feeding, dot attention) vs the soft model with the SAME
        decoder (``HybridForConditionalGeneration`` with those fields); ``--rnn-style bahdanau`` measures the earlier
        setting (Bahdanau-style GRU, additive attention) against the soft hybrid of that decoder;
      * setting 2, future work: Transformer with beam-joint in the last decoder layer vs the soft Transformer.
    Sizes: vocab 8000, d_model 256, 3 encoder layers (+3 decoder layers, or 1 GRU layer of 256), 4 heads, FFN 1024,
    dropout 0.1; batch 64 sentences x 30 source + 30 target tokens, no padding. Training step = forward + backward +
    Adam step. torch.set_num_threads(2); the models' steps are interleaved round by round (load from other processes
    hits all alike) and the median over rounds is reported, as a ratio to the soft model of the same setting.

quality (``--quality``)
    soft vs beam-joint K=6 vs the same beam-joint model decoded with K=1 (the paper's Table 2), and full-joint on
    german-nouns (character-level inflection, exact-match accuracy, greedy) and Multi30k en-de (BLEU, beam 4),
    through ``hf_hardattn.tools.data`` / ``tokenization`` / ``training``. Real numbers need hours of CPU training; run with
    ``--tiny`` it only proves the path works (a few steps on a few hundred examples).

    python benchmarks/beam_joint_bench.py                     # speed -> benchmarks/results/beam_joint_speed_KIND.json
    python benchmarks/beam_joint_bench.py --rounds 3          # quick look
    python benchmarks/beam_joint_bench.py --memory            # peak RSS of a 4096-token step, soft vs K=6
    python benchmarks/beam_joint_bench.py --quality --tiny    # quality path, tiny -> beam_joint_quality_*_KIND.json
    python benchmarks/beam_joint_bench.py --quality --task nouns --setting rnn --minutes 60
"""

import argparse
import json
import os
import statistics
import time

import torch

from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, HybridConfig, HybridForConditionalGeneration,
                         SoftTransformerConfig, SoftTransformerForConditionalGeneration)
from hf_hardattn.tools.training import machine
from machine_kind import default_output

DIMS = dict(vocab_size=8000, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
RNN_DIMS = dict(DIMS, decoder_layers=1, rnn_hidden_size=256)


RNN_STYLES = {  # the RNN decoder of setting 1, the same for the soft and the joint model
    "luong": dict(rnn_decoder_style="luong", rnn_cell="lstm", rnn_attention="dot"),  # the paper's (the default)
    "bahdanau": dict(rnn_decoder_style="bahdanau", rnn_cell="gru", rnn_attention="additive"),  # the earlier GRU setting
}


def build(setting, kind, dims=None, rnn_style="luong", **joint):
    """setting "transformer" | "rnn"; kind "soft" | "joint"; rnn_style: the decoder of setting 1 (RNN_STYLES)."""
    if setting == "transformer":
        dims = dims or DIMS
        if kind == "soft":
            return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**dims))
        return BeamJointTransformerForConditionalGeneration(BeamJointTransformerConfig(**dims, **joint))
    dims = dict(dims or RNN_DIMS, **RNN_STYLES[rnn_style])
    if kind == "soft":
        return HybridForConditionalGeneration(HybridConfig(**dims))
    return BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**dims, **joint))


# ----------------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------------
def make_batch(batch, length, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, length), generator=generator)
    labels = torch.randint(4, vocab, (batch, length), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def speed(args):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    batch = make_batch(args.batch, args.length, DIMS["vocab_size"])
    models = {}
    for setting in ("rnn", "transformer"):
        models[(setting, "soft")] = build(setting, "soft", rnn_style=args.rnn_style)
        for k in args.k:
            models[(setting, f"K={k}")] = build(setting, "joint", rnn_style=args.rnn_style, joint_k=k)
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, m in models.items()}
    times = {name: [] for name in models}

    def step(name):
        model = models[name].train()
        start = time.perf_counter()
        loss = model(**batch).loss
        optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[name].step()
        return time.perf_counter() - start

    for name in models:  # warm-up
        step(name)
    for _ in range(args.rounds):
        for name in models:
            times[name].append(step(name))
    rows = []
    for (setting, kind), values in times.items():
        median = statistics.median(values)
        base = statistics.median(times[(setting, "soft")])
        rows.append(dict(setting=setting, model=kind, step_s=round(median, 4), ratio=round(median / base, 3),
                         params=sum(p.numel() for p in models[(setting, kind)].parameters())))
    lines = ["| setting | model | train step (s, median) | x soft |", "| --- | --- | --- | --- |"]
    for row in rows:
        label = f"1: RNN decoder ({args.rnn_style})" if row["setting"] == "rnn" else "2: Transformer decoder"
        lines.append(f"| {label} | {row['model']} | {row['step_s']:.3f} | {row['ratio']:.2f} |")
    table = "\n".join(lines)
    print(table)
    # memory bound of the mixture (JointMixture): three [chunk_rows, V] buffers (two fp32, one in the GEMM dtype)
    chunk_rows, vocab = BeamJointTransformerConfig().joint_chunk_size, 8000
    memory = dict(chunk_rows=chunk_rows, vocab=vocab, chunk_bytes_fp32=3 * chunk_rows * vocab * 4,
                  chunk_bytes_bf16_autocast=(2 * 4 + 2) * chunk_rows * vocab,
                  output_bytes_4096_tokens=4096 * vocab * 4,
                  unchunked_bytes_4096_tokens_K6_3_tensors=3 * 4096 * 6 * vocab * 4)
    result = dict(batch=args.batch, source_length=args.length, target_length=args.length, rounds=args.rounds,
                  threads=2, dims=DIMS, rnn_dims=dict(RNN_DIMS, **RNN_STYLES[args.rnn_style]), rows=rows,
                  table=table, mixture_memory=memory)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------
MEMORY_CHILD = """
import resource, sys, json, torch
sys.path.insert(0, sys.argv[1])
from beam_joint_bench import build, make_batch
torch.set_num_threads(2)
setting, kind, k, tokens, d = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
dims = dict(vocab_size=8000, d_model=d, encoder_layers=1, decoder_layers=1, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, dropout=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
if setting == "rnn":
    dims.update(rnn_hidden_size=d)
model = build(setting, kind, dims=dims, **({} if kind == "soft" else dict(joint_k=k))).train()
batch = make_batch(tokens // 32, 32, 8000)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model(**batch).loss.backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT" + json.dumps(dict(peak_increase_mib=round((after - before) / 1024, 1))))
"""


def memory(args):
    """Peak resident memory added by one training step (forward + backward), in a fresh process per model: 4096
    target tokens (128 x 32, source 32), vocab 8000, K=6, d_model 512, 1+1 layers (the mixture's memory does not
    depend on depth)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for setting in ("transformer", "rnn"):
        for kind in ("soft", "joint"):
            proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, here, setting, kind, "6", "4096", "512"],
                                  capture_output=True, text=True, check=True)
            value = json.loads(proc.stdout.split("RESULT", 1)[1])["peak_increase_mib"]
            rows.append(dict(setting=setting, model="soft" if kind == "soft" else "K=6", peak_increase_mib=value))
            print(rows[-1], flush=True)
    return dict(target_tokens=4096, vocab=8000, d_model=512, layers="1+1", rows=rows)


# ----------------------------------------------------------------------------------------------------------------
# Quality
# ----------------------------------------------------------------------------------------------------------------
def quality(args):
    from hf_hardattn.tools.data import german_nouns, multi30k
    from hf_hardattn.tools.tokenization import train_tokenizer
    from hf_hardattn.tools.training import accuracy, bleu, tokenize_dataset, train_seq2seq

    torch.set_num_threads(2)
    tiny = args.tiny
    if args.task == "nouns":
        splits = german_nouns(seed=0, max_examples=600 if tiny else args.max_examples)
        train, test = splits["train"], splits["test"]
        tokenizer = train_tokenizer(train, vocab_size=300, kind="char", min_frequency=1)
    else:
        train, test = multi30k("train"), multi30k("test_2016_flickr")
        if tiny:
            train, test = train.select(range(400)), test.select(range(20))
        elif args.max_examples:
            train = train.select(range(min(args.max_examples, len(train))))
        tokenizer = train_tokenizer(train, vocab_size=1000 if tiny else 8000, kind="bpe")
    if tiny:
        test = test.select(range(min(20, len(test))))
    vocab = len(tokenizer)
    if tiny:
        dims = dict(vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.1)
    else:
        dims = dict(vocab_size=vocab, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.2)
    dims.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    if args.setting == "rnn":
        dims.update(decoder_layers=1, rnn_hidden_size=dims["d_model"])
    data = tokenize_dataset(train, tokenizer, max_length=64)
    variants = {"soft": ("soft", {}), "beam_joint_K6": ("joint", dict(joint_k=6))}
    if args.task == "nouns":
        variants["full_joint"] = ("joint", dict(full_joint=True))
    results = {}
    for name, (kind, joint) in variants.items():
        torch.manual_seed(0)
        model = build(args.setting, kind, dims=dims, rnn_style=args.rnn_style, **joint)
        start = time.perf_counter()
        train_seq2seq(model, tokenizer, data, output_dir=os.path.join(args.output, name),
                      max_steps=args.steps if tiny else None, minutes=None if tiny else args.minutes,
                      batch_size=args.batch_size, learning_rate=args.lr, warmup_steps=5 if tiny else 1000,
                      progress=False, logging_steps=max(1, args.steps // 2) if tiny else 100)
        trained_s = time.perf_counter() - start
        decodings = [("", None)]
        if name == "beam_joint_K6":
            decodings.append(("_decoded_K1", 1))  # Table 2: trained with K=6, decoded with K=1
        for suffix, inference_k in decodings:
            if kind == "joint":
                model.config.joint_inference_k = inference_k
            if args.task == "nouns":
                score = accuracy(model, tokenizer, test["source"], test["target"], num_beams=1, max_new_tokens=40)
                metric = dict(accuracy=round(100 * score, 2))
            else:
                score = bleu(model, tokenizer, test["source"], test["target"], num_beams=4)
                metric = dict(bleu=round(score.score, 2))
            results[name + suffix] = dict(train_seconds=round(trained_s, 1), **metric)
            print(name + suffix, results[name + suffix], flush=True)
    return dict(task=args.task, setting=args.setting, tiny=tiny, train_examples=len(train), test_examples=len(test),
                vocab=vocab, dims=dims, results=results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--k", type=int, nargs="+", default=[6])
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--memory", action="store_true", help="peak memory of one training step at 4096 tokens")
    parser.add_argument("--task", choices=("nouns", "multi30k"), default="nouns")
    parser.add_argument("--setting", choices=("rnn", "transformer"), default="rnn")
    parser.add_argument("--rnn-style", choices=tuple(RNN_STYLES), default="luong",
                        help="the RNN decoder of setting 1 (soft and joint alike): luong = the paper's (default)")
    parser.add_argument("--tiny", action="store_true", help="a few steps on a few hundred examples (path check)")
    parser.add_argument("--steps", type=int, default=10, help="training steps with --tiny")
    parser.add_argument("--minutes", type=float, default=60.0, help="training minutes per model without --tiny")
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--output", default="outputs/beam_joint_quality")
    parser.add_argument("--json", default=None, help="result file (default benchmarks/results/beam_joint_*_KIND.json, "
                        "KIND the CPU kind: benchmarks/machine_kind.py)")
    args = parser.parse_args()
    if args.quality:
        result = quality(args)
        name = f"beam_joint_quality_{args.task}_{args.setting}{'_tiny' if args.tiny else ''}"
    elif args.memory:
        result, name = memory(args), "beam_joint_memory"
    else:
        result, name = speed(args), "beam_joint_speed"
    path = args.json or default_output(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"machine": machine(), **result}, handle, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
