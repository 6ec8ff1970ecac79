"""Cost of the numerical guards when they do not fire: the NaN/+inf check of the logits at inference
(``inputs.check_finite_logits``, every model type) and the bound on recurrent cross-attention's carried
context (``RecurrentCrossAttention.check_bounded``, expand_1/2/3).

Models: d_model 256, 3+3 layers, 4 heads, FFN 1024, vocab 8000 (the ``cpu`` preset's sizes), random weights.
Decoding: greedy, batch 32, source length 24, 30 forced new tokens. Training: forward + backward of one batch of 32
(target length 24). Each setting runs the guarded and the unguarded (guards replaced by no-ops) model alternately,
round by round (alternating which goes first), and reports the median time of each and their ratio (guarded / unguarded; 1.00 = no cost).

    PYTHONPATH=. python benchmarks/guard_overhead.py --rounds 9 --threads 2
"""

import argparse
import json
import statistics
import time

import torch

import hf_hardattn.modeling_hardattn as skeleton
from hf_hardattn import (RecurrentConfig, RecurrentForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.recurrent import RecurrentCrossAttention

SIZES = dict(vocab_size=8000, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.0,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, max_position_embeddings=256)


class Guards:
    """Context manager: the guards as shipped (on=True) or replaced by no-ops."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved = skeleton.check_finite_logits, RecurrentCrossAttention.check_bounded
        if not self.on:
            skeleton.check_finite_logits = lambda logits, model: None
            RecurrentCrossAttention.check_bounded = lambda self, *args: None

    def __exit__(self, *exc):
        skeleton.check_finite_logits, RecurrentCrossAttention.check_bounded = self.saved


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {
        "soft": SoftTransformerForConditionalGeneration(SoftTransformerConfig(**SIZES)),
        "recurrent_expand_1": RecurrentForConditionalGeneration(RecurrentConfig(**SIZES)),
    }
    ids = torch.randint(4, 8000, (32, 24))
    mask = torch.ones_like(ids)
    labels = torch.randint(4, 8000, (32, 24))
    results = {}
    for name, model in models.items():
        def decode():
            with torch.no_grad():
                model.eval().generate(input_ids=ids, attention_mask=mask, do_sample=False, min_new_tokens=30,
                                      max_new_tokens=30)

        def train_step():
            model.train()
            model.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

        for setting, fn in (("greedy decode", decode), ("train step", train_step)):
            times = {True: [], False: []}
            for on in (True, False):  # warm-up
                with Guards(on):
                    fn()
            for round_ in range(args.rounds):
                for on in ((True, False) if round_ % 2 == 0 else (False, True)):  # alternate which goes first
                    with Guards(on):
                        times[on].append(timed(fn))
            guarded, bare = statistics.median(times[True]), statistics.median(times[False])
            results[f"{name} {setting}"] = dict(guarded_s=round(guarded, 4), unguarded_s=round(bare, 4),
                                                ratio=round(guarded / bare, 3))
            print(f"{name:20} {setting:14} guarded {guarded:.4f} s  unguarded {bare:.4f} s  ratio {guarded / bare:.3f}",
                  flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
