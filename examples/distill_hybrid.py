"""Train a soft Transformer teacher, distil the hybrid (Transformer encoder + GRU decoder) student, compare BLEU and
decoding speed (hybrid paper, Sec. 2.2 and Table 2) on Multi30k En-De.

Stages:
1. joint BPE tokenizer; soft Transformer teacher trained with MLE;
2. hybrid student pre-trained with MLE on the original data (the paper's first stage);
3. sequence-level KD data: the teacher translates the training sources (beam search, resumable shards); the
   original targets are kept as references;
4. the MLE student is fine-tuned with the stage-2 objective of each ``--kd-scheme`` (``hf_hardattn.tools.distill``),
   each from the same MLE checkpoint and with the same budget: ``eq1_sequence`` (default, the paper's Eq. 1:
   reference NLL + lambda * NLL of the teacher's beam output, Kim & Rush's sequence-level KL), ``eq1_word`` (Eq. 1
   with the per-token KL along the reference), ``sequence_word`` (not Eq. 1: the teacher's output replaces the
   reference, NLL + lambda * per-token KL along it; the scheme of an earlier version of this script), ``sequence_only``
   (not Eq. 1: MLE on the teacher's outputs only);
5. BLEU (sacrebleu, beam 4) of teacher, hybrid (MLE) and each hybrid + KD, and their decoding speed (beam 4, 30
   forced tokens, same test batch).

    python examples/distill_hybrid.py                 # small models, CPU, about 30 minutes
    python examples/distill_hybrid.py --max-steps 5 --train-examples 200 --test-examples 20   # smoke test
    python examples/distill_hybrid.py --paper         # paper sizes: 6-6 teacher d512; hybrid 6-1, GRU 1024 (GPU)
    python examples/distill_hybrid.py --kd-scheme sequence_word eq1_sequence --kd-steps 200   # side by side
    python examples/distill_hybrid.py --data my_data --test-split test --size tiny --max-steps 5   # other data

Reads Multi30k (``hf_hardattn.tools.data.multi30k``: $HF_HARDATTN_MULTI30K or ../shared/data/multi30k), or ``--data
FOLDER`` holding ``train.en`` / ``train.de`` and the ``--test-split`` files alike (``hf_hardattn.tools.data.load_parallel``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from hf_hardattn import (HybridConfig, HybridForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.tools.data import default_multi30k_root, load_parallel
from hf_hardattn.tools.distill import KD_SCHEME_LABELS, KD_SCHEMES, train_kd_stage, translate_dataset
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import bleu, decode_speed, machine, tokenize_dataset, train_seq2seq

SIZES = {
    # small: trains visibly in minutes on 2 CPU cores
    "small": dict(teacher=dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024),
                  student=dict(d_model=256, encoder_layers=3, decoder_layers=1, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=1024, rnn_hidden_size=512),
                  vocab=6000),
    # paper (Sec. 3.1): Transformer-base teacher 6-6, d 512, FFN 2048, 8 heads; hybrid 6-1, 512 embedding, GRU 1024
    "paper": dict(teacher=dict(d_model=512, encoder_layers=6, decoder_layers=6),
                  student=dict(d_model=512, encoder_layers=6, decoder_layers=1, rnn_hidden_size=1024),
                  vocab=8000),
    # tiny: proves the path end to end in seconds (tests/test_examples.py)
    "tiny": dict(teacher=dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
                 student=dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, rnn_hidden_size=64),
                 vocab=300),
}


def log(*args):
    print(*args, flush=True)


def special_ids(tokenizer):
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id)


def kd_finetune(student, teacher, tokenizer, distilled, scheme, args, output_dir):
    """Stage 2 with ``scheme`` (hf_hardattn.tools.distill.train_kd_stage), the same optimiser recipe for every scheme:
    constant learning rate after a short warm-up, ``--kd-minutes`` and/or ``--kd-steps``."""
    steps = args.kd_steps if args.kd_steps is not None else args.max_steps
    runs_teacher, has_lambda = KD_SCHEMES[scheme][2:]
    return train_kd_stage(student, tokenizer, distilled, kd_scheme=scheme,
                          kd_lambda=args.kd_lambda if has_lambda else None,
                          teacher_model=teacher if runs_teacher else None, max_length=64, output_dir=output_dir,
                          minutes=args.kd_minutes, max_steps=steps, batch_size=args.batch_size,
                          learning_rate=args.kd_learning_rate, lr_scheduler="constant_with_warmup",
                          warmup_steps=min(100, steps or 100), seed=args.seed, logging_steps=25)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paper", action="store_true", help="paper sizes (slow on CPU; use a GPU); = --size paper")
    parser.add_argument("--size", choices=list(SIZES), default=None, help="model sizes (default: small)")
    parser.add_argument("--data", default=None, help="folder of {split}.en / {split}.de files (default: Multi30k)")
    parser.add_argument("--test-split", default="test_2016_flickr", help="the split of --data that is scored")
    parser.add_argument("--output-dir", default=os.path.join("outputs", "distill_hybrid"))
    parser.add_argument("--train-examples", type=int, default=None, help="default: all (29k) / 12000 small")
    parser.add_argument("--test-examples", type=int, default=300, help="test sentences scored")
    parser.add_argument("--teacher-minutes", type=float, default=None, help="default 10 small / 120 paper")
    parser.add_argument("--student-minutes", type=float, default=None, help="default 6 small / 60 paper")
    parser.add_argument("--kd-minutes", type=float, default=None, help="default 4 small / 30 paper")
    parser.add_argument("--max-steps", type=int, default=None, help="also stop every training stage after N steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--kd-learning-rate", type=float, default=3e-4)
    parser.add_argument("--kd-lambda", type=float, default=1.0, help="lambda of Eq. 1 (paper: 1)")
    parser.add_argument("--kd-scheme", nargs="+", default=["eq1_sequence"], choices=list(KD_SCHEMES),
                        help="stage-2 objective(s), each fine-tuned from the same MLE student (hf_hardattn.tools.distill)")
    parser.add_argument("--kd-steps", type=int, default=None, help="stage-2 steps (default: --max-steps)")
    parser.add_argument("--rnn-attention", default="additive", choices=["additive", "dot", "multihead"])
    parser.add_argument("--kd-beams", type=int, default=4, help="teacher beam for sequence-level KD")
    parser.add_argument("--speed-repeats", type=int, default=3, help="timed rounds of decoding per model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.paper and args.size not in (None, "paper"):
        parser.error(f"--paper and --size {args.size} contradict each other")
    args.size = "paper" if args.paper else (args.size or "small")
    args.paper = args.size == "paper"
    size = SIZES[args.size]
    defaults = dict(teacher_minutes=(120, 10), student_minutes=(60, 6), kd_minutes=(30, 4))
    for name, (paper, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, paper if args.paper else small)
    if args.train_examples is None and not args.paper:
        args.train_examples = 12000
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    start_all = time.perf_counter()

    # -- data + tokenizer ---------------------------------------------------------------------------------------------
    data = args.data or default_multi30k_root()
    train_raw = load_parallel(data, "train")
    if args.train_examples:
        train_raw = train_raw.shuffle(seed=args.seed).select(range(min(args.train_examples, len(train_raw))))
    test = load_parallel(data, args.test_split)
    test = test.select(range(min(args.test_examples, len(test))))
    tokenizer = train_tokenizer(train_raw, vocab_size=size["vocab"])
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    train = tokenize_dataset(train_raw, tokenizer, max_length=64)
    log(f"data: {len(train_raw)} training pairs, {len(test)} test pairs, BPE vocabulary {len(tokenizer)}")

    # -- 1. teacher ----------------------------------------------------------------------------------------------------
    torch.manual_seed(args.seed)
    teacher_config = SoftTransformerConfig(**size["teacher"], **special_ids(tokenizer))
    teacher = SoftTransformerForConditionalGeneration(teacher_config)
    train_seq2seq(teacher, tokenizer, train, output_dir=os.path.join(args.output_dir, "trainer", "teacher"),
                  minutes=args.teacher_minutes, max_steps=args.max_steps, batch_size=args.batch_size,
                  learning_rate=args.learning_rate, warmup_steps=min(400, args.max_steps or 400), seed=args.seed)
    teacher.save_pretrained(os.path.join(args.output_dir, "teacher"))

    # -- 2. hybrid student, MLE ----------------------------------------------------------------------------------------
    torch.manual_seed(args.seed)
    config = HybridConfig(**size["student"], rnn_attention=args.rnn_attention, **special_ids(tokenizer))
    student = HybridForConditionalGeneration(config)
    train_seq2seq(student, tokenizer, train, output_dir=os.path.join(args.output_dir, "trainer", "hybrid"),
                  minutes=args.student_minutes, max_steps=args.max_steps, batch_size=args.batch_size,
                  learning_rate=args.learning_rate, warmup_steps=min(400, args.max_steps or 400), seed=args.seed)
    student.save_pretrained(os.path.join(args.output_dir, "hybrid_mle"))
    mle_student = HybridForConditionalGeneration.from_pretrained(os.path.join(args.output_dir, "hybrid_mle")).eval()

    # -- 3. sequence-level KD data (resumable: rerunning skips finished shards) ----------------------------------------
    distilled = translate_dataset(teacher, tokenizer, train_raw, os.path.join(args.output_dir, "kd_data"),
                                  num_beams=args.kd_beams, batch_size=64, shard_size=1000, max_new_tokens=64)

    # -- 4. stage 2 from the same MLE student, one run per scheme -----------------------------------------------------
    models = {"teacher (soft Transformer)": teacher, "hybrid (MLE)": mle_student}
    stage2 = {}
    for scheme in dict.fromkeys(args.kd_scheme):
        student = HybridForConditionalGeneration.from_pretrained(os.path.join(args.output_dir, "hybrid_mle"))
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        trainer = kd_finetune(student, teacher, tokenizer, distilled, scheme, args,
                              os.path.join(args.output_dir, "trainer", f"kd_{scheme}"))
        student.save_pretrained(os.path.join(args.output_dir, f"hybrid_kd_{scheme}"))
        stage2[scheme] = dict(steps=trainer.state.global_step, minutes=round((time.perf_counter() - start) / 60, 2),
                              last_parts=trainer.kd_parts, label=KD_SCHEME_LABELS[scheme])
        log(f"KD fine-tuning ({scheme}): {stage2[scheme]}")
        models[f"hybrid + KD ({scheme})"] = student.eval()

    # -- 5. BLEU + speed -----------------------------------------------------------------------------------------------
    batch = tokenizer(test["source"][:32], padding=True, return_tensors="pt")
    results = {}
    for name, model in models.items():
        model.eval()
        score = bleu(model, tokenizer, test["source"], test["target"], num_beams=4, batch_size=64)
        speed = decode_speed(model, batch["input_ids"], batch["attention_mask"], num_beams=4, new_tokens=30,
                             repeats=args.speed_repeats)
        n_layers = f"{model.config.encoder_layers}-{model.config.decoder_layers}"
        results[name] = dict(layers=n_layers, bleu=round(score.score, 2), sentences_per_s=round(speed, 2),
                             params=sum(p.numel() for p in model.parameters()))
    base = results["teacher (soft Transformer)"]["sentences_per_s"]
    log(f"\n| model | N | params | BLEU ({args.test_split}[:{len(test)}], beam 4) | sentences/s (beam 4, batch 32, "
        "30 tokens) | speed-up |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        log(f"| {name} | {r['layers']} | {r['params'] / 1e6:.1f}M | {r['bleu']} | {r['sentences_per_s']} | "
            f"{r['sentences_per_s'] / base:.2f}x |")
    summary = dict(settings=vars(args), machine=machine(), results=results, stage2=stage2,
                   minutes=round((time.perf_counter() - start_all) / 60, 1))
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    log(f"\ntotal {summary['minutes']} min; saved models, KD data and results.json in {args.output_dir}")
    return summary


if __name__ == "__main__":
    main()
