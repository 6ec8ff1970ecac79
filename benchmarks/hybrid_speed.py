"""Decoding speed of the hybrid model (Transformer encoder + 1-layer GRU decoder) against the soft 6-6 Transformer.

Hybrid paper, Table 2: hybrid 6-1 decodes 4.1x faster than the 6-6 Transformer (GPU, beam 12, batch 1). Here:
d_model 512, vocab 8000, random weights, 6 encoder layers for both, forced 30 new tokens (min_new_tokens =
max_new_tokens), greedy and beam 4, batch 1 and 32, ``torch.set_num_threads(2)``; sentences/s = batch / median time
of ``--repeats`` runs, the models measured alternately in the same process.

A breakdown (``--profile``) times, inside ``generate()``, the encoder, the decoder (``model.decode``), the vocabulary
projection (``model.output_logits``) and the rest (generate()'s own per-step work: logits processors, beam
bookkeeping, cache reordering, input preparation), and prints torch.profiler's top operators of the hybrid.

    python benchmarks/hybrid_speed.py                     # table + benchmarks/results/hybrid_speed_KIND.json
    python benchmarks/hybrid_speed.py --quick --profile   # batch 1 only, fewer repeats, plus the breakdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hf_hardattn import HybridConfig, HybridForConditionalGeneration, SoftTransformerConfig, \
    SoftTransformerForConditionalGeneration
from hf_hardattn.tools.training import machine
from machine_kind import machine_kind

COMMON = dict(vocab_size=8000, d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
              dropout=0.0)


def build(kind: str, attention: str = "additive"):
    torch.manual_seed(0)
    if kind == "soft":
        model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(decoder_layers=6, **COMMON))
    else:
        model = HybridForConditionalGeneration(HybridConfig(decoder_layers=1, rnn_hidden_size=1024,
                                                            rnn_attention=attention, **COMMON))
    return model.eval()


def inputs(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 8000, (batch, length), generator=generator)
    ids[:, -1] = 2
    return ids, torch.ones_like(ids)


@torch.no_grad()
def run(model, ids, mask, beams, tokens):
    return model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, do_sample=False,
                          min_new_tokens=tokens, max_new_tokens=tokens)


@torch.no_grad()
def speeds(models: dict, ids, mask, beams, tokens, repeats):
    """sentences/s per model: batch / median time, the models run alternately (same load for all)."""
    for model in models.values():
        run(model, ids, mask, beams, tokens)  # warm-up
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            run(model, ids, mask, beams, tokens)
            times[name].append(time.perf_counter() - start)
    return {name: ids.shape[0] / statistics.median(t) for name, t in times.items()}


class Timers:
    """Wrap encoder / decode / output_logits of one model instance with wall-clock accumulators."""

    def __init__(self, model):
        self.model, self.totals = model, {"encoder": 0.0, "decoder": 0.0, "vocab projection": 0.0}
        encoder = model.get_encoder()
        self._wrap(encoder, "forward", "encoder")
        self._wrap(model, "decode", "decoder")
        self._wrap(model, "output_logits", "vocab projection")

    def _wrap(self, obj, attr, key):
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.totals[key] += time.perf_counter() - start
            return out

        setattr(obj, attr, timed)


@torch.no_grad()
def breakdown(kind, ids, mask, beams, tokens, repeats):
    model = build(kind)
    run(model, ids, mask, beams, tokens)
    timers = Timers(model)
    start = time.perf_counter()
    for _ in range(repeats):
        run(model, ids, mask, beams, tokens)
    total = (time.perf_counter() - start) / repeats
    parts = {k: v / repeats for k, v in timers.totals.items()}
    parts["generate() overhead"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def macs_per_token(model, source_length, target_step):
    """Analytic multiply-accumulates per generated token and hypothesis (decoder + vocabulary projection), and of
    the encoder per source sentence. Explains the compute-bound ratio (large batch x beam)."""
    c = model.config
    d, vocab, s_len, t = c.d_model, c.vocab_size, source_length, target_step
    encoder = c.encoder_layers * s_len * (4 * d * d + 2 * d * c.encoder_ffn_dim + 2 * s_len * d)
    if c.model_type == "hybrid_transformer":
        h, e = c.rnn_hidden_size, c.rnn_embedding_size or d
        query = {"additive": c.additive_attention_size or d, "dot": 0, "multihead": d}[c.rnn_attention]
        score = {"additive": s_len * (c.additive_attention_size or d), "dot": s_len * h, "multihead": s_len * d}
        parts = {"GRU word input (E->3H)": e * 3 * h, "GRU hidden + query (H->3H+Q)": h * (3 * h + query),
                 "attention scores + context": score[c.rnn_attention] + s_len * d,
                 "GRU context input (C->3H)": d * 3 * h,
                 "readout ([H;C]->d)": (h + d) * d}
    else:
        per_layer = dict(self_proj=4 * d * d, self_attn=2 * t * d, cross_proj=2 * d * d, cross_attn=2 * s_len * d,
                         ffn=2 * d * c.decoder_ffn_dim)
        parts = {f"{k} x{c.decoder_layers}": v * c.decoder_layers for k, v in per_layer.items()}
    parts["vocabulary projection"] = d * vocab
    parts["total per token"] = sum(parts.values())
    parts["encoder per sentence"] = encoder
    return parts


@torch.no_grad()
def profile_ops(model, ids, mask, beams, tokens, rows=15):
    from torch.profiler import ProfilerActivity, profile

    run(model, ids, mask, beams, tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(model, ids, mask, beams, tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--source-length", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--attentions", nargs="+", default=["additive"], choices=["additive", "dot", "multihead"])
    parser.add_argument("--quick", action="store_true", help="batch 1 only, 3 repeats")
    parser.add_argument("--profile", action="store_true", help="time breakdown + torch.profiler top operators")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", f"hybrid_speed_{machine_kind()}.json"),
                        help="result JSON, recorded as given (default: relative to the repository root)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.repeats = [1], 3
    torch.set_num_threads(args.threads)

    models = {"soft 6-6": build("soft")}
    for attention in args.attentions:
        models[f"hybrid 6-1 {attention}"] = build("hybrid", attention)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    rows = []
    for batch in args.batches:
        ids, mask = inputs(batch, args.source_length)
        for beams in args.beams:
            result = speeds(models, ids, mask, beams, args.tokens, args.repeats)
            base = result["soft 6-6"]
            for name, value in result.items():
                rows.append(dict(model=name, batch=batch, beams=beams, sentences_per_s=round(value, 2),
                                 speedup=round(value / base, 2)))
                print(f"batch {batch:>2} beam {beams}: {name:<22} {value:8.2f} sent/s  x{value / base:.2f}",
                      flush=True)
    table = ["| model | params | batch | beam | sentences/s | speed-up vs soft 6-6 |", "|---|---|---|---|---|---|"]
    table += [f"| {r['model']} | {params[r['model']] / 1e6:.1f}M | {r['batch']} | {r['beams']} | "
              f"{r['sentences_per_s']} | {r['speedup']}x |" for r in rows]
    print("\n" + "\n".join(table))
    result = dict(settings=dict(vars(args), torch=torch.__version__), rows=rows, table="\n".join(table))

    if args.profile:
        result["macs"] = {}
        for name, model in models.items():
            parts = macs_per_token(model, args.source_length, args.tokens // 2)
            result["macs"][name] = parts
            print(f"\n{name}: MACs per generated token and hypothesis (t={args.tokens // 2}, S={args.source_length}): "
                  + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in parts.items()))
        result["breakdown"] = {}
        for batch in args.batches:
            ids, mask = inputs(batch, args.source_length)
            for kind in ("soft", "hybrid"):
                parts = breakdown(kind, ids, mask, 4, args.tokens, max(1, args.repeats // 2))
                key = f"{kind} batch {batch} beam 4"
                result["breakdown"][key] = {k: round(v * 1000, 1) for k, v in parts.items()}
                print(f"\n{key} (ms per generate): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in parts.items()))
        ids, mask = inputs(args.batches[0], args.source_length)
        ops = profile_ops(models[f"hybrid 6-1 {args.attentions[0]}"], ids, mask, 4, args.tokens)
        print(f"\nhybrid, batch {args.batches[0]}, beam 4: top operators\n{ops}")
        result["hybrid_top_operators"] = ops
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"machine": machine(), **result}, handle, indent=2)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
