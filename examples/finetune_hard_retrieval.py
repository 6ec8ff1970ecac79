"""Fine-tune a pretrained MarianMTModel into hard retrieval attention with ``Seq2SeqTrainer``.

``hf_hardattn.tools.convert`` maps the checkpoint's weights into a ``hard_retrieval_transformer`` (decoder self- and
cross-attention each read ONE key: sampled with straight-through gradients in training, the argmax at inference);
converted, it is the soft-trained model decoded hard, which fine-tuning then adapts. The loss, BLEU and chrF on the
validation data (the training data when none is given) are measured before and after (the Trainer generates with the
model's generation config; the scores come from the package's offline ``evaluate`` metric,
``hf_hardattn.tools.metrics``, through ``translation_metrics``), and the result saved with its tokenizer and model
card.

    python examples/finetune_hard_retrieval.py --model-name-or-path Helsinki-NLP/opus-mt-en-de \\
        --train-file data/train --validation-file data/valid --source-lang en --target-lang de \\
        --max-steps 300 --learning-rate 1e-4 --output-dir opus-mt-en-de-hard

Data files: ``PREFIX`` (``PREFIX.en`` / ``PREFIX.de``, one sentence a line, ``.gz`` allowed), ``FILE.tsv``,
``FILE.jsonl`` or ``hf:NAME[:CONFIG]:SPLIT`` (``hf_hardattn.tools.data.load_split``). BART / mBART / M2M100 checkpoints
convert too.
"""

import argparse
import copy
import json
import os

from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer,
                          Seq2SeqTrainingArguments)

import hf_hardattn
from hf_hardattn.tools.data import load_split
from hf_hardattn.tools.training import translation_metrics


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name-or-path", default="Helsinki-NLP/opus-mt-en-de")
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--validation-file", default=None)
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="de")
    parser.add_argument("--cross-attention-only", action="store_true",
                        help="hard retrieval in cross-attention only (decoder self-attention stays soft)")
    parser.add_argument("--max-source-length", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    source = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    hard = dict(cross_attention="hard_retrieval",
                decoder_attention="soft" if args.cross_attention_only else "hard_retrieval")
    model, report = hf_hardattn.convert(source, "hard_retrieval_transformer", return_report=True, **hard)
    print(report)

    def tokenize(split):
        def encode(batch):
            return tokenizer(batch["source"], text_target=batch["target"], max_length=args.max_source_length,
                             truncation=True)
        return split.map(encode, batched=True, remove_columns=["source", "target"])

    train = tokenize(load_split(args.train_file, args.source_lang, args.target_lang))
    valid = tokenize(load_split(args.validation_file, args.source_lang, args.target_lang)) \
        if args.validation_file else train

    training_args = Seq2SeqTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps, lr_scheduler_type="constant_with_warmup",
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        logging_steps=max(1, args.max_steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        predict_with_generate=True, generation_max_length=args.max_source_length,
    )
    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=valid,
                             processing_class=tokenizer, data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
                             compute_metrics=translation_metrics(tokenizer))  # BLEU and chrF, offline
    generation = copy.deepcopy(model.generation_config)  # evaluating with generate() fills in transformers' defaults
    before = trainer.evaluate(metric_key_prefix="before")
    train_result = trainer.train()
    after = trainer.evaluate(metric_key_prefix="after")
    metrics = {**train_result.metrics, **before, **after}
    trainer.log_metrics("all", metrics)

    model.generation_config = generation  # save the converted model's decoding setting, not those fill-ins
    model.save_pretrained(args.output_dir, tokenizer=tokenizer)  # weights, modeling code, model card, tokenizer
    with open(os.path.join(args.output_dir, "all_results.json"), "w") as handle:
        json.dump(metrics, handle, indent=2)
    print(f"loss (hard retrieval, eval mode) {before['before_loss']:.4f} -> {after['after_loss']:.4f}, BLEU "
          f"{before['before_bleu']:.2f} -> {after['after_bleu']:.2f}, chrF {before['before_chrf']:.2f} -> "
          f"{after['after_chrf']:.2f}; saved in {args.output_dir}")
    return metrics


if __name__ == "__main__":
    main()
