"""BLEU on Multi30k En->De: soft baseline vs recurrent cross-attention variants (Rosendahl et al., Table 2).

Every model is trained from scratch with the same recipe and the same number of optimizer steps (a step budget, not
a time budget, so that the slower recurrent models are not penalised by a loaded CPU), then decoded with beam 4 on
test_2016_flickr. Sizes: d_model 256, 3+3 layers, 4 heads, FFN 1024, joint BPE vocabulary 8000, dropout 0.1.

The paper's finding to compare with: no variant is significantly better than the baseline. Meaningful numbers need
thousands of steps (hours on this CPU); ``--max-steps 200`` only checks that the pipeline runs.

    python benchmarks/recurrent_bleu.py --variants expand_1 coverage --max-steps 3000
    python benchmarks/recurrent_bleu.py --max-steps 100 --eval-size 100 --variants expand_1   # smoke run
"""

import argparse
import json
import os
import time

import torch

from hf_hardattn import RecurrentConfig, RecurrentForConditionalGeneration, SoftTransformerConfig
from hf_hardattn import SoftTransformerForConditionalGeneration
from hf_hardattn.tools.data import multi30k
from hf_hardattn.recurrent import RECURRENT_VARIANTS
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import bleu, machine, tokenize_dataset, train_seq2seq
from machine_kind import default_output

DIMS = dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.1)


def build(name, tokenizer):
    special = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id)
    if name == "soft":
        return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS, **special))
    return RecurrentForConditionalGeneration(RecurrentConfig(recurrent_variant=name, **DIMS, **special))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["expand_1", "concat_weight", "continuity", "coverage"],
                        choices=list(RECURRENT_VARIANTS))
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=400)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--eval-size", type=int, default=None, help="first N test sentences (default: all 1000)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true", help="skip the soft baseline (e.g. a second run)")
    parser.add_argument("--output", default=default_output("recurrent_bleu"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train, test = multi30k("train"), multi30k("test_2016_flickr")
    if args.eval_size:
        test = test.select(range(min(args.eval_size, len(test))))
    tokenizer = train_tokenizer(train, vocab_size=8000)
    train_tok = tokenize_dataset(train, tokenizer)
    results = {}
    for name in ([] if args.no_baseline else ["soft"]) + args.variants:
        torch.manual_seed(0)
        model = build(name, tokenizer)
        start = time.perf_counter()
        trainer = train_seq2seq(model, tokenizer, train_tok, output_dir=f"/tmp/recurrent_bleu/{name}",
                                max_steps=args.max_steps, batch_size=args.batch_size,
                                learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, progress=False)
        train_s = time.perf_counter() - start
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        score = bleu(model, tokenizer, test["source"], test["target"], num_beams=4)
        results[name] = dict(bleu=round(score.score, 2), train_s=round(train_s, 1), steps=args.max_steps,
                             last_loss=losses[-1] if losses else None)
        print(name, results[name], flush=True)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(dict(machine=machine(), dims=DIMS, args=vars(args), results=results), handle, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
