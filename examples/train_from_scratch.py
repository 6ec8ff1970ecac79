"""Train a translation model of any hf_hardattn type from scratch on your parallel data.

A joint tokenizer is trained on the training split (``hf_hardattn.tools.tokenization.train_tokenizer``: byte-level BPE, or
characters), the model is built with ``AutoConfig.for_model`` / ``AutoModelForSeq2SeqLM.from_config`` and trained
with the package's recipe (``hf_hardattn.tools.training.train_seq2seq``: ``Seq2SeqTrainer``, Adam betas (0.9, 0.98),
warm-up then inverse square root decay, length-grouped batches). With validation data it reports BLEU (sacrebleu,
beam 4). The folder it saves (weights, tokenizer, model card) loads with ``AutoModelForSeq2SeqLM.from_pretrained``.

    python examples/train_from_scratch.py --model-type hard_retrieval_transformer \\
        --train ../shared/data/multi30k/train --validation ../shared/data/multi30k/val --source-lang en \\
        --target-lang de --d-model 256 --layers 3 --heads 4 --ffn-dim 1024 --max-steps 20000 --output-dir hard-m30k
    python examples/train_from_scratch.py --model-type hybrid_transformer --set decoder_layers=1 \\
        --set rnn_attention='"dot"' --train data/train --output-dir hybrid     # any config field with --set

Data: ``PREFIX`` (``PREFIX.en`` / ``PREFIX.de``, one sentence a line, ``.gz`` allowed), ``FILE.tsv``, ``FILE.jsonl``
or ``hf:NAME[:CONFIG]:SPLIT`` (``hf_hardattn.tools.data.load_split``). ``hf-hardattn train`` is the full command (resume,
early stopping, several processes).
"""

import argparse
import json
import os

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import hf_hardattn
from hf_hardattn.tools.data import load_split
from hf_hardattn.gaussian import length_ratio_unless_given
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import bleu, tokenize_dataset, train_seq2seq


def key_value(text):
    """``--set key=value``: the value read as JSON (numbers, true/false, lists, quoted strings), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="hard_retrieval_transformer", choices=list(hf_hardattn.MODEL_TYPES))
    parser.add_argument("--train", required=True, help="training data spec")
    parser.add_argument("--validation", default=None, help="validation data spec (BLEU after training)")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="de")
    parser.add_argument("--tokenizer-kind", default="bpe", choices=["bpe", "char"])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3, help="encoder and decoder layers")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--set", dest="overrides", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="any other config field (repeatable)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    train_raw = load_split(args.train, args.source_lang, args.target_lang)
    tokenizer = train_tokenizer(train_raw, vocab_size=args.vocab_size, kind=args.tokenizer_kind)
    print(f"{len(train_raw)} training pairs; joint {args.tokenizer_kind} vocabulary of {len(tokenizer)}")

    torch.manual_seed(args.seed)
    fields = dict(
        vocab_size=len(tokenizer), d_model=args.d_model, encoder_layers=args.layers, decoder_layers=args.layers,
        encoder_attention_heads=args.heads, decoder_attention_heads=args.heads, encoder_ffn_dim=args.ffn_dim,
        decoder_ffn_dim=args.ffn_dim, max_position_embeddings=args.max_length, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id)
    config = AutoConfig.for_model(args.model_type, **{**fields, **dict(args.overrides)})
    length_ratio_unless_given(config, train_raw, tokenizer)  # hard-coded Gaussian cross-attention: gamma of the data
    model = AutoModelForSeq2SeqLM.from_config(config)
    print(f"{args.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    train = tokenize_dataset(train_raw, tokenizer, max_length=args.max_length)
    trainer = train_seq2seq(model, tokenizer, train, output_dir=args.output_dir, max_steps=args.max_steps,
                            batch_size=args.batch_size, learning_rate=args.learning_rate,
                            warmup_steps=args.warmup_steps, seed=args.seed,
                            logging_steps=max(1, args.max_steps // 20))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    results = dict(model_type=args.model_type, steps=trainer.state.global_step, vocab_size=len(tokenizer),
                   first_loss=losses[0], last_loss=losses[-1])
    if args.validation:
        valid = load_split(args.validation, args.source_lang, args.target_lang)
        score = bleu(model, tokenizer, valid["source"], valid["target"], num_beams=4)
        results["bleu"] = round(score.score, 2)

    model.save_pretrained(args.output_dir, tokenizer=tokenizer)  # weights, tokenizer, model card
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
