"""Decoding speed: soft vs hard retrieval vs "attention removed" vs transformers.MarianMTModel, same dimensions.

All models: d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 8000, random weights. 30 output tokens are forced
(min_new_tokens = max_new_tokens = 30, no forced EOS), greedy and beam 4, batch 1 and 32, median of repeats, all
in one process so the ratios compare like with like.

* ``attention removed``: the soft model whose attention *core* (scores, normalisation, weighted sum) returns a value
  row without looking at any score; projections, caches and everything else are kept. It is the ceiling for any
  change that only replaces the attention function, such as hard retrieval.
* ``marian``: ``transformers.MarianMTModel`` with the same sizes (shared embeddings, no forced EOS).

    python benchmarks/decode_speed.py                    # full table, writes benchmarks/results/decode_speed.json
    python benchmarks/decode_speed.py --repeats 3 --batch-sizes 1 --modes greedy   # quick look
"""

import argparse
import json
import os
import statistics
import time

import torch

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn import (HardRetrievalConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.modeling_hardattn import SoftAttention

DIMS = dict(vocab_size=8000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def removed_attend(q, k, v, mask, causal):
    """No scores, no normalisation, no weighted sum: every query returns the first value row."""
    return v[:, :, :1].expand(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def build_soft():
    return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS, **SPECIAL))


def build_hard():
    return HardRetrievalForConditionalGeneration(HardRetrievalConfig(**DIMS, **SPECIAL))


def build_removed():
    model = build_soft()
    for module in model.modules():
        if isinstance(module, SoftAttention):
            module.attend = removed_attend
    return model


def build_marian():
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=DIMS["vocab_size"], d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="relu",
        scale_embedding=True, share_encoder_decoder_embeddings=True, forced_eos_token_id=None,
        max_position_embeddings=512, **SPECIAL,
    )
    return MarianMTModel(config)


BUILDERS = {"soft": build_soft, "hard_retrieval": build_hard, "attention_removed": build_removed,
            "marian": build_marian}


def make_inputs(batch_size, source_length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DIMS["vocab_size"], (batch_size, source_length), generator=generator)
    ids[:, -1] = SPECIAL["eos_token_id"]
    return ids, torch.ones_like(ids)


def sentences_per_second(model, ids, mask, num_beams, new_tokens, repeats):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=num_beams, do_sample=False,
                  use_cache=True)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # warm-up
        assert out.shape[1] == new_tokens + 1, out.shape
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            times.append(time.perf_counter() - start)
    return ids.shape[0] / statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--modes", nargs="+", default=["greedy", "beam4"], choices=["greedy", "beam4"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "decode_speed.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {name: BUILDERS[name]().eval() for name in args.models}
    rows = []
    for mode in args.modes:
        beams = 4 if mode == "beam4" else 1
        for batch_size in args.batch_sizes:
            ids, mask = make_inputs(batch_size)
            speeds = {}
            for name, model in models.items():
                speeds[name] = sentences_per_second(model, ids, mask, beams, args.new_tokens, args.repeats)
            rows.append({"mode": mode, "batch_size": batch_size, "sentences_per_s": speeds})
            print(f"{mode:7s} batch {batch_size:3d}: " + ", ".join(f"{n} {s:.2f}" for n, s in speeds.items()), flush=True)
    ratios = [
        ("soft / marian", "soft", "marian"),
        ("hard_retrieval / soft", "hard_retrieval", "soft"),
        ("hard_retrieval / attention_removed", "hard_retrieval", "attention_removed"),
        ("attention_removed / soft", "attention_removed", "soft"),
    ]
    ratios = [r for r in ratios if r[1] in models and r[2] in models]
    header = "| mode | batch | " + " | ".join(f"{n} sent/s" for n in models) + " | " + " | ".join(r[0] for r in ratios) + " |"
    lines = [header, "|" + " --- |" * (2 + len(models) + len(ratios))]
    for row in rows:
        s = row["sentences_per_s"]
        row["ratios"] = {label: s[a] / s[b] for label, a, b in ratios}
        lines.append(f"| {row['mode']} | {row['batch_size']} | " + " | ".join(f"{s[n]:.2f}" for n in models) + " | "
                     + " | ".join(f"{row['ratios'][r[0]]:.2f}x" for r in ratios) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump({"settings": {**DIMS, "new_tokens": args.new_tokens, "threads": args.threads,
                                "repeats": args.repeats, "source_length": 24, "torch": torch.__version__},
                   "rows": rows, "table": table}, handle, indent=2)
    return rows


if __name__ == "__main__":
    main()
