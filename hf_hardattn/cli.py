"""The ``hf-hardattn`` command (also ``python -m hf_hardattn``).

* ``hf-hardattn demo``: offline, CPU, a few minutes: train a soft Transformer and a hard-retrieval Transformer on
  German noun inflection (character level), print their held-out exact-match accuracy and greedy decoding speed,
  save both (weights, tokenizer, model card) and reload one through ``AutoModelForSeq2SeqLM``.
* ``hf-hardattn tokenizer --files a.gz b.gz --vocab-size 8000 --out DIR``: train and save a joint tokenizer.
* ``hf-hardattn distill --teacher DIR --data FOLDER --split train --out DIR``: sequence-level knowledge
  distillation, translate a dataset with a teacher (see :mod:`hf_hardattn.distill`).
* ``hf-hardattn convert SRC OUT --model-type T [--set key=value ...]``: map a pretrained Marian / BART / mBART /
  M2M100 checkpoint into an hf_hardattn model type (see :mod:`hf_hardattn.convert`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never needs the network

# Demo model sizes: "small" learns visibly in ~3 minutes on 2 CPU cores; "tiny" is for tests (seconds).
DEMO_SIZES = {
    "small": dict(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512),
    "tiny": dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
}


def _print(*args):
    print(*args, flush=True)


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------------------------
def run_demo(args) -> dict:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from . import (HardRetrievalConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig,
                   SoftTransformerForConditionalGeneration)
    from .data import german_nouns
    from .safe_io import write_json_atomic
    from .tokenization import train_tokenizer
    from .training import accuracy, decode_speed, tokenize_dataset, train_seq2seq

    import datasets

    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # keep the training bars, not the save / load bars
    torch.set_num_threads(args.threads)
    size = DEMO_SIZES["tiny" if args.tiny else "small"]
    per_model = args.minutes / 2
    _print(f"hf_hardattn demo: German noun inflection (character level), soft vs hard-retrieval Transformer\n"
           f"  training budget {args.minutes:g} min ({per_model:g} min per model), torch threads "
           f"{torch.get_num_threads()}, output {args.output_dir}")

    # -- data + tokenizer -----------------------------------------------------------------------------------------
    start = time.perf_counter()
    data = german_nouns(seed=args.seed, max_examples=args.max_examples)
    tokenizer = train_tokenizer(data["train"], kind="char", min_frequency=2)
    train = tokenize_dataset(data["train"], tokenizer, max_length=args.max_length)
    test = data["test"].shuffle(seed=args.seed)
    test = test.select(range(min(args.eval_examples, len(test))))
    copy_baseline = sum(lemma == target for lemma, target in zip(test["lemma"], test["target"])) / len(test)
    _print(f"data: {len(data['train'])} train / {len(data['validation'])} validation / {len(data['test'])} test "
           f"examples, split by lemma (no test lemma is seen in training); e.g. {data['train'][0]['source']!r} -> "
           f"{data['train'][0]['target']!r}\n"
           f"  character vocabulary {len(tokenizer)} (tags such as <gen> are single tokens); evaluating on "
           f"{len(test)} test examples; copy-the-lemma baseline {100 * copy_baseline:.1f}% "
           f"[{time.perf_counter() - start:.1f}s]")

    variants = [
        ("soft", SoftTransformerConfig, SoftTransformerForConditionalGeneration),
        ("hard", HardRetrievalConfig, HardRetrievalForConditionalGeneration),
    ]
    results, models = {}, {}
    for name, config_class, model_class in variants:
        torch.manual_seed(args.seed)
        config = config_class(vocab_size=len(tokenizer), max_position_embeddings=args.max_length, dropout=0.1,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id,
                              **size)
        model = model_class(config)
        params = sum(p.numel() for p in model.parameters())
        _print(f"\n[{name}] {model_class.__name__}: encoder {config.encoder_attention}, decoder self "
               f"{config.decoder_attention}, cross {config.cross_attention}; {params:,} parameters")
        start = time.perf_counter()
        trainer = train_seq2seq(
            model, tokenizer, train, output_dir=os.path.join(args.output_dir, "trainer", name),
            minutes=per_model, max_steps=args.max_steps, batch_size=args.batch_size,
            learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed, logging_steps=25,
        )
        train_seconds = time.perf_counter() - start
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        steps = trainer.state.global_step
        start = time.perf_counter()
        acc, predictions = accuracy(model, tokenizer, test["source"], test["target"], num_beams=1,
                                    batch_size=args.eval_batch_size, max_new_tokens=args.max_length,
                                    return_predictions=True)
        _print(f"[{name}] {steps} steps in {train_seconds / 60:.1f} min"
               + (f", loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else "")
               + f"; test exact match {100 * acc:.1f}% (greedy, {time.perf_counter() - start:.1f}s)")
        results[name] = dict(params=params, steps=steps, train_minutes=round(train_seconds / 60, 2),
                             first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                             accuracy=acc, predictions=predictions)
        models[name] = model
        try:  # the Trainer's output folder stays empty (save_strategy "no")
            os.removedirs(os.path.join(args.output_dir, "trainer", name))
        except OSError:
            pass

    # -- greedy decoding speed, same inputs, measured alternately -------------------------------------------------
    batch = tokenizer(test["source"][: args.speed_batch], padding=True, return_tensors="pt")
    speeds = {name: [] for name in models}
    for _ in range(args.speed_rounds):
        for name, model in models.items():
            speeds[name].append(decode_speed(model, batch["input_ids"], batch["attention_mask"], num_beams=1,
                                             new_tokens=args.speed_tokens, repeats=3))
    for name in models:
        results[name]["sentences_per_second"] = sorted(speeds[name])[len(speeds[name]) // 2]
    ratio = results["hard"]["sentences_per_second"] / results["soft"]["sentences_per_second"]

    # -- save (weights + tokenizer + model card with the results) -------------------------------------------------
    for name, model in models.items():
        folder = os.path.join(args.output_dir, name)
        os.makedirs(folder, exist_ok=True)
        r = results[name]
        card = {
            "task": "German noun inflection (german-nouns package), character level, split by lemma",
            "test exact match (greedy)": f"{100 * r['accuracy']:.1f}% on {len(test)} examples",
            "copy-the-lemma baseline": f"{100 * copy_baseline:.1f}%",
            "training": f"{r['steps']} steps, {r['train_minutes']} min on CPU (hf-hardattn demo)",
            "greedy sentences/s": f"{r['sentences_per_second']:.1f} (batch {args.speed_batch}, "
                                  f"{args.speed_tokens} tokens)",
        }
        write_json_atomic(os.path.join(folder, "hardattn_results.json"), card)
        # one atomic save: the model card (from hardattn_results.json), weights, checksums and tokenizer replace the
        # folder together, so a killed demo leaves the previous complete model
        model.save_pretrained(folder, tokenizer=tokenizer)

    # -- reload one through the Auto classes ----------------------------------------------------------------------
    folder = os.path.join(args.output_dir, "hard")
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    picks = random.Random(args.seed).sample(range(len(test)), min(args.show, len(test)))
    _, shown = accuracy(reloaded, reloaded_tokenizer, [test["source"][i] for i in picks],
                        [test["target"][i] for i in picks], num_beams=1, max_new_tokens=args.max_length,
                        return_predictions=True)
    same = shown == [results["hard"]["predictions"][i] for i in picks]
    _print(f"\nreloaded {folder} with AutoModelForSeq2SeqLM.from_pretrained -> {type(reloaded).__name__} "
           f"(same predictions as before saving: {same}); unseen test lemmas:")
    _print(f"  {'lemma':<26} {'tag':<16} {'prediction':<28} reference")
    for i, prediction in zip(picks, shown):
        mark = "ok" if prediction == test["target"][i] else "--"
        tag = (f"<{test['gender'][i]}> " if test["gender"][i] else "") + test["tag"][i]
        _print(f"  {test['lemma'][i]:<26} {tag:<16} {prediction:<28} {test['target'][i]}  {mark}")

    _print(f"\nresults (test: {len(test)} forms of unseen lemmas, greedy decoding)")
    _print(f"  {'model':<6} {'params':>9} {'steps':>6} {'exact match':>12} {'sentences/s':>12}")
    for name in models:
        r = results[name]
        _print(f"  {name:<6} {r['params']:>9,} {r['steps']:>6} {100 * r['accuracy']:>11.1f}% "
               f"{r['sentences_per_second']:>12.1f}")
    _print(f"  copy-the-lemma baseline: {100 * copy_baseline:.1f}%")
    _print(f"  greedy decoding speed ratio hard/soft: {ratio:.2f}x (same {len(batch['input_ids'])} test inputs, "
           f"{args.speed_tokens} new tokens, median of {args.speed_rounds} alternating rounds)")
    _print(f"  saved: {os.path.join(args.output_dir, 'soft')}, {os.path.join(args.output_dir, 'hard')} "
           f"(model + tokenizer + README.md model card)")
    for r in results.values():
        r.pop("predictions")
    summary = dict(results=results, copy_baseline=copy_baseline, speed_ratio_hard_over_soft=ratio,
                   eval_examples=len(test))
    write_json_atomic(os.path.join(args.output_dir, "demo_results.json"), summary)
    return summary


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------
def run_tokenizer(args):
    from .safe_io import atomic_folder
    from .tokenization import train_tokenizer

    missing = [path for path in args.files if not os.path.isfile(path)]
    if missing:
        raise SystemExit(f"--files: not found: {missing}")
    tokenizer = train_tokenizer(args.files, vocab_size=args.vocab_size, kind=args.kind,
                                min_frequency=args.min_frequency)
    with atomic_folder(args.out) as staging:  # a killed save leaves the earlier tokenizer (or none), never half one
        tokenizer.save_pretrained(staging)
    _print(f"{args.kind} tokenizer with {len(tokenizer)} tokens (pad/bos/eos/unk = 0/1/2/3) saved to {args.out}")


# ----------------------------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------------------------
def _assignment(text):
    """``key=value`` -> (key, value): the value parsed as JSON (numbers, true/false, null, lists, quoted strings), or
    else taken as the string it is (``recurrent_variant=coverage``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _tokenizer_files(folder) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("tokenizer_config.json", "tokenizer.json"))


def run_convert(args):
    """Convert, then write OUT through a temporary folder beside it, renamed into place once complete: on bad input
    (or any failure) nothing is written and the command exits with a one-line error."""
    import shutil
    import tempfile

    def fail(error):
        raise SystemExit(f"hf-hardattn convert: error: {' '.join(str(error).split())}")

    out = os.path.abspath(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        fail(f"OUT={args.out!r} exists and is not an empty folder; allowed: a new or empty folder.")
    from .convert import convert

    try:
        pairs = [_assignment(text) for text in args.set or []]
        overrides = dict(pairs)
        if len(overrides) != len(pairs):
            raise ValueError(f"--set gives a key more than once: {[key for key, _ in pairs]}")
        model, report = convert(args.source, args.model_type, return_report=True, **overrides)
        tokenizer = None
        if os.path.isdir(args.source) and _tokenizer_files(args.source):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.source)
    except (ValueError, TypeError, OSError, ImportError) as error:
        fail(error)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(staging, tokenizer=tokenizer)
        if os.path.isdir(out):
            os.rmdir(out)  # (empty, checked above)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _print(str(report))
    _print(f"saved {args.model_type} to {args.out} (weights, config, code, model card"
           + (", the source's tokenizer)" if tokenizer is not None else
              "; SRC holds no tokenizer: save the source's tokenizer beside it)"))


# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-hardattn", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train soft + hard-retrieval models on German noun inflection (CPU, minutes)")
    demo.add_argument("--minutes", type=_positive_float, default=6.0,
                      help="total training time, split equally between the two models (default 6)")
    demo.add_argument("--output-dir", default=os.path.join("outputs", "demo"))
    demo.add_argument("--max-examples", type=_positive_int, default=60_000,
                      help="examples taken from the task before splitting by lemma (default 60000)")
    demo.add_argument("--eval-examples", type=_positive_int, default=1000, help="test examples scored (default 1000)")
    demo.add_argument("--max-steps", type=_positive_int, default=None, help="also stop each model after this many steps")
    demo.add_argument("--batch-size", type=_positive_int, default=64)
    demo.add_argument("--eval-batch-size", type=_positive_int, default=250)
    demo.add_argument("--learning-rate", type=_positive_float, default=2e-3)
    demo.add_argument("--warmup-steps", type=int, default=200)
    demo.add_argument("--max-length", type=_positive_int, default=64, help="token limit of sources and targets")
    demo.add_argument("--speed-batch", type=_positive_int, default=32, help="test inputs decoded for the speed ratio")
    demo.add_argument("--speed-tokens", type=_positive_int, default=16, help="new tokens per sentence when timing")
    demo.add_argument("--speed-rounds", type=_positive_int, default=3)
    demo.add_argument("--show", type=_positive_int, default=8, help="example inflections printed")
    demo.add_argument("--threads", type=_positive_int, default=1,
                      help="torch CPU threads (default 1: these small models gain little from more, and one thread "
                           "keeps its speed when other programs share the cores)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--tiny", action="store_true", help="tiny models (a smoke test, learns little)")
    demo.set_defaults(func=run_demo)

    tok = sub.add_parser("tokenizer", help="train a joint tokenizer on text files and save it")
    tok.add_argument("--files", nargs="+", required=True, help="text files, one sentence a line (.gz allowed)")
    tok.add_argument("--vocab-size", type=_positive_int, default=8000)
    tok.add_argument("--kind", choices=("bpe", "char"), default="bpe")
    tok.add_argument("--min-frequency", type=_positive_int, default=2)
    tok.add_argument("--out", required=True, help="output folder (loads with AutoTokenizer.from_pretrained)")
    tok.set_defaults(func=run_tokenizer)

    from .distill import add_distill_arguments, run_distill

    distill = sub.add_parser("distill", help="sequence-level KD: translate a dataset with a teacher (beam search, "
                                             "resumable shards) into a distilled dataset")
    add_distill_arguments(distill)
    distill.set_defaults(func=run_distill)

    from . import MODEL_CLASSES

    convert = sub.add_parser(
        "convert", help="map a pretrained MarianMTModel / BART / mBART / M2M100 checkpoint into an hf_hardattn model",
        description="Convert a pretrained translation model into an hf_hardattn model type. soft_transformer "
                    "reproduces the source exactly; the other Transformer types get every parameter they share with "
                    "it, and the report printed lists what was initialised or dropped. The hybrid types (GRU decoder) "
                    "are refused: distil the converted soft model into them (hf-hardattn distill). On bad input the "
                    "command exits with a one-line error and writes nothing.")
    convert.add_argument("source", metavar="SRC",
                         help="folder of a MarianMTModel, BartForConditionalGeneration, "
                              "MBartForConditionalGeneration or M2M100ForConditionalGeneration (NLLB); its tokenizer, "
                              "when the folder holds one, is saved with the converted model (a Hub id works with "
                              "HF_HUB_OFFLINE=0: the command runs offline by default)")
    convert.add_argument("out", metavar="OUT", help="output folder, new or empty: weights (safetensors), config, "
                                                    "modeling code (trust_remote_code), model card, tokenizer")
    types = sorted(config_class.model_type for config_class in MODEL_CLASSES)
    convert.add_argument("--model-type", required=True, metavar="T",
                         help=f"the hf_hardattn model type to convert to: one of {', '.join(types)} "
                              f"(beam_joint_rnn and hybrid_transformer, with a GRU decoder, are refused with the "
                              f"distillation route)")
    convert.add_argument("--set", action="append", metavar="KEY=VALUE",
                         help="override a field of the target config that the source does not fix (repeatable), "
                              "e.g. --set dropout=0.1 --set recurrent_variant=coverage --set "
                              "'cross_attention=[\"soft\", \"hard_retrieval\"]'; VALUE is parsed as JSON (numbers, "
                              "true/false, null, lists), anything else is taken as a string")
    convert.set_defaults(func=run_convert)

    from .reproduce import add_arguments as add_reproduce_arguments
    from .reproduce import run as run_reproduce

    reproduce = sub.add_parser("reproduce", help="train and evaluate every variant with one recipe (the papers' "
                                                 "tables; resumable) -> JSON + markdown table")
    add_reproduce_arguments(reproduce)
    reproduce.set_defaults(func=run_reproduce)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
