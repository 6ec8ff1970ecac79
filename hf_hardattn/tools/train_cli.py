"""``hf-hardattn train``: any model type (or a pretrained / converted checkpoint) on the user's own data.

Data: one spec per split (``--train``, ``--validation``, ``--test``; see :func:`hf_hardattn.tools.data.load_split`:
``PREFIX.{src}`` / ``PREFIX.{tgt}`` files, TSV, JSON Lines, ``hf:NAME[:CONFIG]:SPLIT``), any language pair
(``--source-lang`` / ``--target-lang``). Tokenizer: an existing one (``--tokenizer``, or the ``--init-from`` folder's)
or a joint one trained on the training split. Model: ``--model-type`` with sizes from flags, ``--config`` (JSON or
YAML) and ``--set key=value``; or ``--init-from`` a saved hf_hardattn folder (fine-tuned as it is) or a MarianMTModel /
BART / mBART / M2M100 folder (converted to ``--model-type`` first, see :mod:`hf_hardattn.tools.convert`).

Training is :func:`hf_hardattn.tools.training.train_seq2seq` (Seq2SeqTrainer underneath): with ``--validation`` and
``--eval-steps``, BLEU of the validation split (beam ``--num-beams``) every N steps, a checkpoint at each, the best
one restored at the end (``load_best_model_at_end``) and optional early stopping (``--early-stopping PATIENCE``);
``--save-steps`` without validation checkpoints for resuming only; ``--resume`` continues from the last *complete*
checkpoint of ``--output-dir`` (a checkpoint a kill left half written is skipped). The final model goes to
``OUTPUT_DIR/model`` with its tokenizer and a card holding the validation and test BLEU and the exact command;
``OUTPUT_DIR/results.json`` has the same numbers and ``OUTPUT_DIR/{validation,test}.hyp`` the translations scored.

Multi-process (CPU: gloo; GPU: NCCL), through the Trainer: ``torchrun --nproc_per_node 2 -m hf_hardattn train ...``
or ``accelerate launch --multi_gpu --num_processes 2 -m hf_hardattn train ...`` (on a CPU-only machine this starts 2
CPU processes; ``accelerate launch --cpu --num_processes 2`` starts one, and is refused, see
:func:`hf_hardattn.tools.training.check_processes_started`). ``--batch-size`` is per process. Tooling, not runtime code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, EarlyStoppingCallback, set_seed

from hf_hardattn_cli.arguments import CommandError, positive_float, positive_int
from hf_hardattn_cli.scores import corpus_scores

from ..gaussian import PRESETS, length_ratio_unless_given
from ..model_card import CARD_METADATA, RESULTS_FILE, write_model_card
from ..registry import MODEL_TYPES
from ..registry import model_classes as registered_classes
from ..safe_io import atomic_folder, write_json_atomic
from . import training
from .arguments import assignment, check_model_type
from .convert import convert
from .data import load_split
from .tokenization import min_vocab_size, train_tokenizer

SIZE_FLAGS = {  # flag -> config fields it sets
    "d_model": ("d_model",), "encoder_layers": ("encoder_layers",), "decoder_layers": ("decoder_layers",),
    "heads": ("encoder_attention_heads", "decoder_attention_heads"),
    "ffn_dim": ("encoder_ffn_dim", "decoder_ffn_dim"), "dropout": ("dropout",),
    "label_smoothing": ("label_smoothing",), "max_positions": ("max_position_embeddings",),
}


def _error(message):
    return CommandError(" ".join(str(message).split()))


def read_config_file(path: str) -> dict:
    """Config fields from a JSON or YAML file (a mapping)."""
    if not os.path.isfile(path):
        raise _error(f"--config={path!r} is not a file.")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml  # (optional: PyYAML, for YAML configs only)

            fields = yaml.safe_load(text)
        else:
            fields = json.loads(text)
    except Exception as error:  # json / yaml parse errors
        raise _error(f"--config={path!r} does not parse ({error}).") from error
    if not isinstance(fields, dict):
        raise _error(f"--config={path!r} must hold a mapping of config fields, got {type(fields).__name__}.")
    return fields


def config_fields(args) -> dict:
    """--config, then the size flags, then --set (later wins)."""
    fields = read_config_file(args.config) if args.config else {}
    for flag, names in SIZE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            fields.update({name: value for name in names})
    pairs = [assignment(text) for text in args.set or []]
    fields.update(dict(pairs))
    return fields


def load_data(args) -> dict:
    splits = {}
    for name in ("train", "validation", "test"):
        spec = getattr(args, name)
        if spec is None:
            continue
        try:
            splits[name] = load_split(spec, args.source_lang, args.target_lang, args.source_column, args.target_column)
        except (ValueError, FileNotFoundError) as error:
            raise _error(f"--{name}: {error}") from error
    return splits


def tokenizer_folder(args):
    """The folder the run's tokenizer loads from (``--tokenizer``, or the ``--init-from`` folder's), or None: trained."""
    return args.tokenizer or (args.init_from if args.init_from and os.path.isfile(
        os.path.join(args.init_from, "tokenizer_config.json")) else None)


def build_tokenizer(args, splits):
    source = tokenizer_folder(args)
    if source:
        try:
            return AutoTokenizer.from_pretrained(source), source
        except (OSError, ValueError) as error:
            raise _error(f"no tokenizer loads from {source!r} ({error}).") from error
    tokenizer = train_tokenizer(splits["train"], vocab_size=args.vocab_size, kind=args.tokenizer_kind)
    folder = os.path.join(args.output_dir, "tokenizer")
    with atomic_folder(folder) as staging:  # a killed save leaves no half tokenizer for --resume to load
        tokenizer.save_pretrained(staging)
    return tokenizer, folder


def model_classes(model_type: str):
    if model_type not in MODEL_TYPES:
        raise _error(f"--model-type={model_type!r} is not an hf_hardattn model type; allowed: "
                     f"{', '.join(sorted(MODEL_TYPES))}.")
    return registered_classes(model_type)


def check_model_arguments(args, fields):
    """Before any work (no tokenizer trained, no folder made): the model type, --gaussian-preset's type and the config
    fields (--config, the size flags, --set) are built into a trial config, so a bad type, a misspelled field or a
    refused value ends the command here. A saved --init-from model is checked for misspelled fields only (its
    config is read later)."""
    config_class, _ = model_classes(args.model_type)
    if args.gaussian_preset and args.model_type != "gaussian_transformer":
        raise _error(f"--gaussian-preset={args.gaussian_preset!r} applies to --model-type gaussian_transformer only, "
                     f"got --model-type={args.model_type!r}.")
    try:
        if args.init_from:
            config_class.check_typed_keys(fields)
            return
    except (ValueError, TypeError) as error:  # the keys go to from_pretrained(--init-from, key=value)
        raise _error(f"--init-from={args.init_from!r} with --set {fields}: {error}") from error
    try:
        with warnings.catch_warnings():  # (an unknown field's warning comes once, from the real config)
            warnings.simplefilter("ignore")
            if args.gaussian_preset:
                config_class.preset(args.gaussian_preset, **fields)
            else:
                config_class(**fields)
    except (ValueError, TypeError) as error:
        raise _error(f"--model-type={args.model_type!r} with --config / --set {fields}: {error}") from error


def build_model(args, tokenizer, splits, fields):
    """(model, how it was made)."""
    config_class, model_class = model_classes(args.model_type)
    special = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=tokenizer.bos_token_id,
                   decoder_start_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None
                   else tokenizer.pad_token_id)
    if args.init_from:
        try:
            check_model_type(args.init_from, "--init-from")
            stored = AutoConfig.from_pretrained(args.init_from)
        except (OSError, ValueError) as error:
            raise _error(f"--init-from={args.init_from!r} holds no loadable config ({error}).") from error
        try:
            if stored.model_type == args.model_type:  # an hf_hardattn model of this type: fine-tune it as it is
                return AutoModelForSeq2SeqLM.from_pretrained(args.init_from, **fields), "loaded"
            return convert(args.init_from, args.model_type, **fields), f"converted from {stored.model_type}"
        except (ValueError, TypeError) as error:
            raise _error(f"--init-from={args.init_from!r}: {error}") from error
    kwargs = dict(special, **fields)
    try:
        if args.gaussian_preset:
            if args.model_type != "gaussian_transformer":
                raise ValueError("--gaussian-preset applies to --model-type gaussian_transformer only.")
            config = config_class.preset(args.gaussian_preset, **kwargs)
            length_ratio_unless_given(config, splits["train"], tokenizer)  # hc-all: fitted on --train unless given
        else:
            config = config_class(**kwargs)
    except (ValueError, TypeError) as error:
        raise _error(error) from error
    return model_class(config), "new"


def check_lengths(tokenized, name, max_length, skip):
    """Examples longer than ``max_length`` tokens on either side: an error, or (``skip``) dropped and counted."""
    long = [i for i, (a, b) in enumerate(zip(tokenized["input_ids"], tokenized["labels"]))
            if len(a) > max_length or len(b) > max_length]
    if not long:
        return tokenized, 0
    if not skip:
        raise _error(f"{len(long)} {name} pair(s) are longer than --max-length={max_length} tokens (the first: pair "
                     f"{long[0] + 1}); raise --max-length (within the model's positions) or pass --skip-long to leave "
                     f"them out (counted in results.json). Nothing is truncated.")
    keep = sorted(set(range(len(tokenized))) - set(long))
    return tokenized.select(keep), len(long)


def run_train(args) -> dict:
    try:
        training.check_processes_started()  # before any work: an accelerate launch that started fewer processes
    except ValueError as error:
        raise _error(error) from error
    torch.set_num_threads(args.threads)
    if args.eval_steps and not args.validation:
        raise _error("--eval-steps needs --validation (the split it scores).")
    if args.early_stopping and not args.eval_steps:
        raise _error("--early-stopping needs --validation and --eval-steps (it counts evaluations without a gain).")
    if args.max_steps is None and args.minutes is None and args.epochs is None:
        raise _error("give the training length: --max-steps, --minutes or --epochs.")
    least = min_vocab_size(args.tokenizer_kind)
    if tokenizer_folder(args) is None and args.vocab_size < least:
        raise _error(f"--vocab-size={args.vocab_size} is below {least}, the least a {args.tokenizer_kind} tokenizer "
                     f"has (see hf_hardattn.tools.tokenization.min_vocab_size); allowed: >= {least}.")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.tokenizer and not args.init_from:
        raise _error("a multi-process run needs --tokenizer (or --init-from with one): train it first with "
                     "`hf-hardattn tokenizer`, so that every process reads the same vocabulary.")
    try:
        training.check_bf16(args.bf16, name="--bf16", fix="Drop --bf16 (fp32)")
        training.check_fp16(args.fp16, name="--fp16")
    except ValueError as error:
        raise _error(error) from error
    fields = config_fields(args)
    check_model_arguments(args, fields)
    splits = load_data(args)
    os.makedirs(args.output_dir, exist_ok=True)  # only once every argument has passed: bad input leaves no folder
    tokenizer, tokenizer_source = build_tokenizer(args, splits)
    set_seed(args.seed)  # the initial weights too (every process of a multi-process run builds the same model)
    model, origin = build_model(args, tokenizer, splits, fields)
    max_length = args.max_length
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and max_length > positions:
        raise _error(f"--max-length={max_length} exceeds the model's max_position_embeddings={positions}.")
    tokenized, skipped = {}, {}
    for name, split in splits.items():
        data = training.tokenize_dataset(split, tokenizer, max_length=max_length + 1)  # + 1: see what is too long
        tokenized[name], skipped[name] = check_lengths(data, name, max_length, args.skip_long)
    batch_size = args.batch_size
    if args.max_tokens:
        lengths = [max(len(a), len(b)) for a, b in zip(tokenized["train"]["input_ids"], tokenized["train"]["labels"])]
        batch_size = max(1, round(args.max_tokens / (sum(lengths) / len(lengths))))
    extra = dict(bf16=args.bf16, fp16=args.fp16)
    callbacks = []
    if args.eval_steps:
        extra.update(save_steps=args.eval_steps, load_best_model_at_end=True, metric_for_best_model="bleu",
                     greater_is_better=True, predict_with_generate=True, generation_num_beams=args.num_beams,
                     save_total_limit=args.save_total_limit)
        if args.early_stopping:
            callbacks.append(EarlyStoppingCallback(early_stopping_patience=args.early_stopping))
    elif args.save_steps:
        extra.update(save_steps=args.save_steps, save_total_limit=args.save_total_limit)
    kwargs = dict(resume_from_checkpoint=True) if args.resume else {}
    # the run's one decoding setting, in the model's generation config from the start: the Trainer's evaluations, each
    # checkpoint, the final model, its scores below and generate() without arguments all decode with it
    model.generation_config.num_beams, model.generation_config.max_new_tokens = args.num_beams, max_length
    try:
        trainer = training.train_seq2seq(
            model, tokenizer, tokenized["train"], tokenized.get("validation") if args.eval_steps else None,
            output_dir=os.path.join(args.output_dir, "trainer"), max_steps=args.max_steps, minutes=args.minutes,
            epochs=args.epochs or 1.0, batch_size=batch_size, learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps, lr_scheduler=args.lr_scheduler, seed=args.seed,
            eval_steps=args.eval_steps, progress=not args.quiet, callbacks=callbacks,
            **(dict(compute_metrics=training.translation_metrics(tokenizer)) if args.eval_steps else {}), **kwargs, **extra)
    except ValueError as error:
        raise _error(error) from error
    model = trainer.model
    results = dict(model_type=args.model_type, origin=origin, tokenizer=tokenizer_source, steps=trainer.state.global_step,
                   batch_size=batch_size, processes=trainer.args.world_size, skipped_long=skipped,
                   precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32", seed=args.seed,
                   machine=training.machine(),
                   command=" ".join(["hf-hardattn"] + [shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:])]))
    results["decoding"] = training.decoding_setting(model)  # of every score below and of the saved model
    if args.eval_steps:
        results["best_validation_bleu"] = round(trainer.state.best_metric, 2)
        results["best_checkpoint"] = trainer.state.best_model_checkpoint
    for name in ("validation", "test"):
        if name in splits and trainer.is_world_process_zero():  # sacrebleu on the final model, its saved decoding
            hypotheses = training.translate(model, tokenizer, splits[name]["source"],
                                            num_beams=model.generation_config.num_beams,
                                            max_new_tokens=model.generation_config.max_new_tokens, max_length=max_length)
            for key, (score, signature) in corpus_scores(hypotheses, [splits[name]["target"]]).items():
                results[f"{name}_{key}"] = round(score.score, 2)
                results[f"{key}_signature"] = f"{signature} ({results['decoding']})"
            with open(os.path.join(args.output_dir, f"{name}.hyp"), "w", encoding="utf-8") as handle:
                handle.write("".join(line + "\n" for line in hypotheses))
    results = {k: v for k, v in results.items() if v is not None}
    if trainer.is_world_process_zero():
        folder = os.path.join(args.output_dir, "model")
        model.save_pretrained(folder, tokenizer=tokenizer)
        write_json_atomic(os.path.join(folder, RESULTS_FILE), card_results(args, results, tokenizer_source))
        write_model_card(model, folder)
        write_json_atomic(os.path.join(args.output_dir, "results.json"), results)
        print(json.dumps(results, indent=1), flush=True)
    training.end_processes()
    return results


def public_text(text: str) -> str:
    """``text`` (a command, a path) with each local path in it cut to its last component: cards go to the Hub."""
    words = []
    for word in shlex.split(str(text)):
        flag, value = word.split("=", 1) if word.startswith("--") and "=" in word else (None, word)
        prefix, path = ("hf:", value[3:].split(":")[0]) if value.startswith("hf:") else ("", value)
        if os.path.isabs(path) or os.path.exists(path) or (os.sep in path and os.path.isdir(os.path.dirname(path))):
            value = prefix + os.path.basename(os.path.normpath(path)) + value[len(prefix) + len(path):]
        words.append(shlex.quote(value) if flag is None else f"{flag}={shlex.quote(value)}")
    return " ".join(words)


def hub_dataset(spec: str | None):
    """(dataset id, config, split) of an ``hf:NAME[:CONFIG]:SPLIT`` spec whose NAME is a Hub id, else None."""
    if not spec or not spec.startswith("hf:"):
        return None
    parts = spec[3:].split(":")
    if len(parts) not in (2, 3) or os.path.exists(parts[0]):
        return None
    return parts[0], (parts[1] if len(parts) == 3 else None), parts[-1]


def card_results(args, results: dict, tokenizer_source: str) -> dict:
    """What the model card shows (``hardattn_results.json``): the run's numbers and command without local paths, and
    the Hub metadata (``CARD_METADATA``): both languages, the license, the Hub datasets, and a model-index entry per
    validation / test BLEU and chrF with sacrebleu's signature."""
    table = {k: v for k, v in results.items() if k not in ("skipped_long", "best_checkpoint", "tokenizer", "origin",
                                                           "command")}
    table["origin"] = public_text(results["origin"])
    trained = os.path.normpath(tokenizer_source) == os.path.normpath(os.path.join(args.output_dir, "tokenizer"))
    table["tokenizer"] = (f"trained on the training split ({args.tokenizer_kind}, {args.vocab_size} entries at most)"
                          if trained else public_text(tokenizer_source))
    if results.get("best_checkpoint"):
        table["best_step"] = int(results["best_checkpoint"].rstrip("/").rsplit("-", 1)[-1])
    table["command"] = public_text(results["command"])
    machine = results["machine"]
    threads = "" if machine["gpu"] else f"{machine['threads']} threads, "
    table["machine"] = f"{machine['gpu'] or machine['cpu']}, {threads}torch {machine['torch']}"
    datasets = list(args.dataset or [])
    evals = []
    for name in ("validation", "test"):
        spec = getattr(args, name)
        known = hub_dataset(spec)
        if known:
            datasets.append(known[0])
        if f"{name}_bleu" not in results:
            continue
        # a Hub dataset id only for data from the Hub (hf:NAME, --dataset); local data: dataset_type None, so the
        # card names it local:NAME (model_card.eval_result), never read as a Hub id
        dataset_id, config, split = known or ((args.dataset[0], None, name) if args.dataset else (None, None, name))
        dataset_name = dataset_id or os.path.basename(os.path.normpath(spec))
        for key, pretty in (("bleu", "BLEU"), ("chrf", "chrF")):
            evals.append(dict(task_type="translation", task_name=f"Translation {args.source_lang}-{args.target_lang}",
                              dataset_type=dataset_id, dataset_name=dataset_name,
                              dataset_config=config or f"{args.source_lang}-{args.target_lang}", dataset_split=split,
                              metric_type=key, metric_value=results[f"{name}_{key}"],
                              metric_name=f"{name} {pretty} ({results['decoding']})",
                              metric_config=results[f"{key}_signature"].rsplit(" (beam", 1)[0]))
    hub_datasets = hub_dataset(args.train)
    if hub_datasets:
        datasets.insert(0, hub_datasets[0])
    table[CARD_METADATA] = dict(language=[args.source_lang, args.target_lang], license=args.license,
                                datasets=list(dict.fromkeys(datasets)) or None, eval_results=evals or None)
    return table


def add_arguments(parser: argparse.ArgumentParser):
    data = parser.add_argument_group("data (one spec per split: PREFIX with PREFIX.SRC / PREFIX.TGT files, FILE.tsv, "
                                     "FILE.jsonl, hf:NAME[:CONFIG]:SPLIT, or a save_to_disk folder)")
    data.add_argument("--train", required=True, help="training split spec")
    data.add_argument("--validation", default=None, help="validation split spec (BLEU, best checkpoint)")
    data.add_argument("--test", default=None, help="test split spec (BLEU at the end)")
    data.add_argument("--source-lang", required=True, help="source language code, e.g. en (file suffix / column)")
    data.add_argument("--target-lang", required=True, help="target language code, e.g. de")
    data.add_argument("--source-column", default=None, help="TSV/JSONL/datasets column of the source (default: "
                                                           "--source-lang, or translation.SRC)")
    data.add_argument("--target-column", default=None, help="column of the target (default: --target-lang)")
    data.add_argument("--dataset", action="append", default=None, metavar="HUB_ID",
                      help="Hub dataset id the data comes from, for the model card (repeatable; hf: specs are named "
                           "without it)")
    data.add_argument("--max-length", type=positive_int, default=128, help="longest source/target in tokens (128)")
    data.add_argument("--skip-long", action="store_true",
                      help="leave out pairs longer than --max-length (counted) instead of stopping with an error")

    model = parser.add_argument_group("model")
    model.add_argument("--model-type", required=True, help="an hf_hardattn model type, e.g. hard_retrieval_transformer")
    model.add_argument("--init-from", default=None, help="start from a saved hf_hardattn folder of that type, or a "
                                                         "MarianMTModel / BART / mBART / M2M100 folder (converted)")
    model.add_argument("--config", default=None, help="JSON or YAML file of config fields")
    model.add_argument("--gaussian-preset", choices=PRESETS, default=None,
                       help="gaussian_transformer: the paper's configurations (hc-all fits its length ratio on --train)")
    model.add_argument("--d-model", dest="d_model", type=positive_int, default=None, help="model width")
    model.add_argument("--encoder-layers", type=positive_int, default=None, help="encoder layers")
    model.add_argument("--decoder-layers", type=positive_int, default=None, help="decoder layers (RNN layers for "
                                                                                 "the hybrid types)")
    model.add_argument("--heads", type=positive_int, default=None, help="attention heads (encoder and decoder)")
    model.add_argument("--ffn-dim", type=positive_int, default=None, help="feed-forward size (encoder and decoder)")
    model.add_argument("--dropout", type=float, default=None, help="dropout probability")
    model.add_argument("--label-smoothing", type=float, default=None, help="label smoothing of the loss")
    model.add_argument("--max-positions", type=positive_int, default=None, help="max_position_embeddings")
    model.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config field (repeatable; JSON value)")

    tok = parser.add_argument_group("tokenizer (default: a joint one trained on --train)")
    tok.add_argument("--tokenizer", default=None, help="an existing tokenizer folder")
    tok.add_argument("--vocab-size", type=positive_int, default=8000,
                     help="size of a trained tokenizer (8000; bpe: at least 260, char: an upper bound, at least 5)")
    tok.add_argument("--tokenizer-kind", choices=("bpe", "char"), default="bpe", help="byte-level BPE or characters")

    run = parser.add_argument_group("training")
    run.add_argument("--output-dir", required=True, help="checkpoints (trainer/), the final model (model/), results.json")
    run.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps")
    run.add_argument("--minutes", type=positive_float, default=None, help="wall-clock training budget")
    run.add_argument("--epochs", type=positive_float, default=None, help="passes over --train")
    run.add_argument("--batch-size", type=positive_int, default=64, help="sentences per batch (per process)")
    run.add_argument("--max-tokens", type=positive_int, default=None,
                     help="tokens per batch instead (converted with the mean training length)")
    run.add_argument("--learning-rate", type=positive_float, default=5e-4, help="peak learning rate (5e-4)")
    run.add_argument("--warmup-steps", type=int, default=1000, help="linear warm-up steps (1000)")
    run.add_argument("--lr-scheduler", choices=("inverse_sqrt", "linear", "cosine", "constant_with_warmup"),
                     default="inverse_sqrt", help="learning-rate schedule after the warm-up (inverse_sqrt)")
    precision = run.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs; CPUs with AVX512-BF16 or AMX)")
    precision.add_argument("--fp16", action="store_true",
                           help="fp16 autocast with a loss scaler (GPUs, e.g. those without bf16; not on a CPU)")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights, data order, dropout")
    run.add_argument("--eval-steps", type=positive_int, default=None,
                     help="validation BLEU and a checkpoint every N steps; the best is kept as the final model")
    run.add_argument("--early-stopping", type=positive_int, default=None, metavar="PATIENCE",
                     help="stop after PATIENCE evaluations without a better validation BLEU")
    run.add_argument("--save-steps", type=positive_int, default=None, help="checkpoints for --resume (no validation)")
    run.add_argument("--save-total-limit", type=positive_int, default=None, help="keep at most this many checkpoints")
    run.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    run.add_argument("--num-beams", type=positive_int, default=4, help="beam size of the BLEU evaluations (4)")
    run.add_argument("--threads", type=positive_int, default=max(1, min(os.cpu_count() or 1, 8)),
                     help="torch CPU threads per process")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--license", default="apache-2.0",
                     help="license of the trained model, for the model card (default apache-2.0, the package's; "
                          "mind the data's)")
