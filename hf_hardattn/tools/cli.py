"""The ``hf-hardattn`` command (also ``python -m hf_hardattn``).

* ``hf-hardattn demo``: offline, CPU, a few minutes: train a soft Transformer and a hard-retrieval Transformer on
  German noun inflection (character level), print their held-out exact-match accuracy and greedy decoding speed,
  save both (weights, tokenizer, model card) and reload one through ``AutoModelForSeq2SeqLM``.
* ``hf-hardattn tokenizer --files a.gz b.gz --vocab-size 8000 --out DIR``: train and save a joint tokenizer.
* ``hf-hardattn distill --teacher DIR --data FOLDER --split train --out DIR``: sequence-level knowledge
  distillation, translate a dataset with a teacher (see :mod:`hf_hardattn.tools.distill`).
* ``hf-hardattn convert SRC OUT --model-type T [--set key=value ...]``: map a pretrained Marian / BART / mBART /
  M2M100 checkpoint into an hf_hardattn model type (see :mod:`hf_hardattn.tools.convert`).
* ``hf-hardattn translate MODEL [-i FILE] [-o FILE]``: translate a text file (or stdin) with any saved seq2seq model,
  one sentence a line, batched and length-sorted; prints sentences/s.
* ``hf-hardattn score HYP REF [REF ...]``: BLEU and chrF of a hypothesis file with sacrebleu's signatures.
* ``hf-hardattn publish MODEL REPO_ID``: build the upload folder (weights, tokenizer, code, card with the run's metrics
  and command), validate it by loading it as remote code in a fresh offline process, then push it in one commit.
* ``hf-hardattn plot MODEL [MODEL ...] --source TEXT``: attention heat maps of one sentence (PNG), per model and side
  by side (see :mod:`hf_hardattn.tools.plot`).

Bad input (a missing file, a bad option value, files of different lengths) ends the command with a one-line error
and exit status 2 (``HF_HARDATTN_TRACEBACK=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

import huggingface_hub
import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from .. import packed_linear
from ..hard_retrieval import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from ..model_card import CARD_METADATA, RESULTS_FILE, metrics_table, write_model_card
from ..registry import MODEL_TYPES, ROLES
from ..safe_io import atomic_folder, write_json_atomic
from ..soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from .arguments import (CommandError, assignment, check_model_type, lazy_import, offline_by_default, positive_float,
                        positive_int)
from .convert import convert
from .plot import attention_maps, plot_comparison, plot_layers
from .scores import corpus_scores

# Loaded on first use (``lazy_import``), so that --help and --version start without them: the Trainer, the data and
# tokenizer tooling and datasets.
datasets = lazy_import("datasets")
data = lazy_import("hf_hardattn.tools.data")
hf_hardattn_distill = lazy_import("hf_hardattn.tools.distill")  # (not `distill`: build_parser's subparser)
reproduce = lazy_import("hf_hardattn.tools.reproduce")
tokenization = lazy_import("hf_hardattn.tools.tokenization")
train_cli = lazy_import("hf_hardattn.tools.train_cli")
training = lazy_import("hf_hardattn.tools.training")

# Demo model sizes: "small" learns visibly in ~3 minutes on 2 CPU cores; "tiny" is for tests (seconds).
DEMO_SIZES = {
    "small": dict(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512),
    "tiny": dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64),
}


def _print(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------------------------
def run_demo(args) -> dict:
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
    nouns = data.german_nouns(seed=args.seed, max_examples=args.max_examples)
    tokenizer = tokenization.train_tokenizer(nouns["train"], kind="char", min_frequency=2)
    train = training.tokenize_dataset(nouns["train"], tokenizer, max_length=args.max_length)
    test = nouns["test"].shuffle(seed=args.seed)
    test = test.select(range(min(args.eval_examples, len(test))))
    copy_baseline = sum(lemma == target for lemma, target in zip(test["lemma"], test["target"])) / len(test)
    _print(f"data: {len(nouns['train'])} train / {len(nouns['validation'])} validation / {len(nouns['test'])} test "
           f"examples, split by lemma (no test lemma is seen in training); e.g. {nouns['train'][0]['source']!r} -> "
           f"{nouns['train'][0]['target']!r}\n"
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
                              embed_init_std=None,  # character level: N(0, d^-1/2) embeddings (0.02 is worse here)
                              **size)
        model = model_class(config)
        params = sum(p.numel() for p in model.parameters())
        _print(f"\n[{name}] {model_class.__name__}: encoder {config.encoder_attention}, decoder self "
               f"{config.decoder_attention}, cross {config.cross_attention}; {params:,} parameters")
        start = time.perf_counter()
        trainer = training.train_seq2seq(
            model, tokenizer, train, output_dir=os.path.join(args.output_dir, "trainer", name),
            minutes=per_model, max_steps=args.max_steps, batch_size=args.batch_size,
            learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed, logging_steps=25,
        )
        train_seconds = time.perf_counter() - start
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        steps = trainer.state.global_step
        start = time.perf_counter()
        acc, predictions = training.accuracy(model, tokenizer, test["source"], test["target"], num_beams=1,
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
            speeds[name].append(training.decode_speed(model, batch["input_ids"], batch["attention_mask"], num_beams=1,
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
    _, shown = training.accuracy(reloaded, reloaded_tokenizer, [test["source"][i] for i in picks],
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
    missing = [path for path in args.files if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"--files: not found: {missing}")
    least = tokenization.min_vocab_size(args.kind)
    if args.vocab_size < least:
        raise CommandError(f"--vocab-size={args.vocab_size} is below {least}, the least a {args.kind} tokenizer has "
                           f"(see hf_hardattn.tools.tokenization.min_vocab_size); allowed: >= {least}.")
    tokenizer = tokenization.train_tokenizer(args.files, vocab_size=args.vocab_size, kind=args.kind,
                                min_frequency=args.min_frequency)
    with atomic_folder(args.out) as staging:  # a killed save leaves the earlier tokenizer (or none), never half one
        tokenizer.save_pretrained(staging)
    _print(f"{args.kind} tokenizer with {len(tokenizer)} tokens (pad/bos/eos/unk = 0/1/2/3) saved to {args.out}")


# ----------------------------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------------------------
def _tokenizer_files(folder) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("tokenizer_config.json", "tokenizer.json"))


def run_convert(args):
    """Convert, then write OUT through a temporary folder beside it, renamed into place once complete: on bad input
    (or any failure) nothing is written and the command exits with a one-line error."""
    def fail(error):
        raise CommandError(" ".join(str(error).split()))

    out = os.path.abspath(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        fail(f"OUT={args.out!r} exists and is not an empty folder; allowed: a new or empty folder.")
    try:
        pairs = [assignment(text) for text in args.set or []]
        overrides = dict(pairs)
        if len(overrides) != len(pairs):
            raise ValueError(f"--set gives a key more than once: {[key for key, _ in pairs]}")
        model, report = convert(args.source, args.model_type, return_report=True, **overrides)
        tokenizer = None
        if os.path.isdir(args.source) and _tokenizer_files(args.source):
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
# translate / score
# ----------------------------------------------------------------------------------------------------------------
def read_lines(path: str, name: str) -> list[str]:
    """The lines of a text file (``.gz`` read through gzip; ``-`` = stdin), without their line ends."""
    if path == "-":
        return [line.rstrip("\n") for line in sys.stdin]
    if not os.path.isfile(path):
        raise CommandError(f"{name}={path!r} is not a file.")
    try:  # (as data.read_lines, without loading the data tooling and datasets: score starts light)
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle]
    except (UnicodeDecodeError, OSError) as error:
        raise CommandError(f"{name}={path!r} cannot be read as UTF-8 text ({error}).") from error


def write_lines(path: str, lines: list[str]):
    """Write ``lines`` (``-`` = stdout); a file goes through a temporary name, renamed once complete."""
    text = "".join(line + "\n" for line in lines)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(partial, path)


def load_for_translation(model_path: str, tokenizer_path: str | None):
    """(model, tokenizer) of a saved seq2seq folder: any hf_hardattn type, or a transformers model (MarianMTModel,
    BART, ...). Errors name the folder."""
    try:
        check_model_type(model_path)
    except ValueError as error:
        raise CommandError(str(error)) from error
    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as error:
        raise CommandError(f"MODEL={model_path!r} does not load as a seq2seq model "
                           f"({' '.join(str(error).split())[:300]}).") from error
    source = tokenizer_path or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CommandError(f"no tokenizer loads from {source!r} ({' '.join(str(error).split())[:200]}); save it "
                           f"beside the model or give --tokenizer.") from error
    return model, tokenizer


def source_limit(model) -> int | None:
    """The longest source (in tokens) the model's positions cover, or None where the model has no such limit."""
    return getattr(model.config, "max_position_embeddings", None)


def run_translate(args):
    if args.int8_engine and not args.int8:
        raise CommandError(f"--int8-engine={args.int8_engine} needs --int8 (it picks the kernels of the int8 layers).")
    if args.int8 and (args.pack_linears or args.dtype != "float32"):
        other = "--pack-linears" if args.pack_linears else f"--dtype {args.dtype}"
        raise CommandError(f"--int8 and {other} exclude each other: int8 layers replace the packed fp32 ones and run "
                           f"on float32 inputs; choose one.")
    if args.pack_linears and not packed_linear.packing_available():
        raise CommandError("--pack-linears needs oneDNN's prepacked linear layers, which this torch build lacks; "
                           "translate without it (or with --int8).")
    torch.set_num_threads(args.threads)
    lines = read_lines(args.input, "--input")
    model, tokenizer = load_for_translation(args.model, args.tokenizer)
    if args.pack_linears:
        if not hasattr(model, "pack_linears"):
            raise CommandError(f"--pack-linears needs an hf_hardattn model; {args.model!r} is a "
                               f"{type(model).__name__}.")
        model.pack_linears()
    if args.int8:
        if not hasattr(model, "quantize_int8"):
            raise CommandError(f"--int8 needs an hf_hardattn model; {args.model!r} is a {type(model).__name__}.")
        model.eval().quantize_int8(engine=args.int8_engine or "fbgemm")
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    positions = source_limit(model)
    if args.max_source_tokens and positions and args.max_source_tokens > positions:
        raise CommandError(f"--max-source-tokens={args.max_source_tokens} exceeds the model's "
                           f"max_position_embeddings={positions}; allowed: 1 to {positions}.")
    limit = args.max_source_tokens or positions or 1024
    todo = [i for i, line in enumerate(lines) if line.strip()]  # an empty line stays an empty line
    lengths = [len(ids) for ids in tokenizer([lines[i] for i in todo])["input_ids"]] if todo else []
    too_long = next(((todo[j], n) for j, n in enumerate(lengths) if n > limit), None)
    if too_long is not None:
        raise CommandError(f"line {too_long[0] + 1} of --input={args.input!r} has {too_long[1]} tokens, more than "
                           f"--max-source-tokens={limit}; split the sentence (it is never truncated).")
    sampling = dict(top_k=args.top_k, top_p=args.top_p, temperature=args.temperature) if args.do_sample else {}
    if args.do_sample:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    try:
        outputs = training.translate(model, tokenizer, [lines[i] for i in todo], num_beams=args.num_beams,
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, max_length=limit,
                            progress=not args.quiet, do_sample=args.do_sample, **sampling)
    except ValueError as error:
        raise CommandError(" ".join(str(error).split())) from error
    seconds = time.perf_counter() - start
    result = [""] * len(lines)
    for i, text in zip(todo, outputs):
        result[i] = text
    write_lines(args.output, result)
    if not args.quiet:
        rate = len(todo) / seconds if seconds > 0 else float("inf")
        print(f"hf-hardattn translate: {len(todo)} sentences in {seconds:.1f} s, {rate:.2f} sentences/s "
              f"(beam {args.num_beams}, batch {args.batch_size}, {torch.get_num_threads()} threads)", file=sys.stderr,
              flush=True)


SCORE_METRICS = ("bleu", "chrf")


def run_score(args) -> list[dict]:
    """sacrebleu's corpus BLEU / chrF of HYP against one or more reference files (same number of lines), computed by
    :func:`hf_hardattn.tools.scores.corpus_scores` as the package's evaluate metric computes them."""
    hypotheses = read_lines(args.hypotheses, "HYP")
    references = [read_lines(path, "REF") for path in args.references]
    if not hypotheses:
        raise CommandError(f"HYP={args.hypotheses!r} has no lines; a corpus score needs at least one hypothesis.")
    for path, lines in zip(args.references, references):
        if len(lines) != len(hypotheses):
            raise CommandError(f"REF={path!r} has {len(lines)} lines and HYP={args.hypotheses!r} has "
                               f"{len(hypotheses)}; every reference file needs one line per hypothesis.")
    results = []  # the evaluate metric's numbers (hf_hardattn.tools.metrics), without importing evaluate
    scores = corpus_scores(hypotheses, references, metrics=args.metrics, tokenize=args.tokenize,
                           lowercase=args.lowercase)
    for score, signature in scores.values():
        results.append(dict(name=score.name, score=round(score.score, 4), signature=signature,
                            text=score.format(signature=signature)))
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "text"} for r in results], indent=1), flush=True)
    else:
        for r in results:
            _print(r["text"])
    return results


def run_plot(args) -> list[str]:
    names = args.names or [os.path.basename(os.path.normpath(path)) for path in args.models]
    if len(names) != len(args.models):
        raise CommandError(f"--names gives {len(names)} names for {len(args.models)} models; give one per MODEL.")
    if len(set(names)) != len(names):
        raise CommandError(f"model names must differ (they name the files), got {names}; use --names.")
    written, named = [], []
    for path, name in zip(args.models, names):
        model, tokenizer = load_for_translation(path, args.tokenizer)
        try:
            maps = attention_maps(model, tokenizer, args.source, args.target, role=args.role,
                                  max_new_tokens=args.max_new_tokens)
        except ValueError as error:
            raise CommandError(f"{name}: {' '.join(str(error).split())}") from error
        written.append(plot_layers(maps, os.path.join(args.out, f"{name}_{args.role}.png"),
                                   title=f"{name}: {args.role} attention"))
        named.append((name, maps))
        _print(f"{name}: {maps['target']!r} -> {written[-1]}")
    if len(named) > 1:
        written.append(plot_comparison(named, os.path.join(args.out, f"comparison_{args.role}.png")))
        _print(f"comparison -> {written[-1]}")
    return written


VALIDATE_SCRIPT = r"""
import json, sys
sys.modules["hf_hardattn"] = None  # the folder must load without the package: as remote code
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
folder, sentence = sys.argv[1], sys.argv[2]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # (no y/N prompt)
with torch.no_grad():
    ids = model.generate(**tokenizer([sentence], return_tensors="pt"), num_beams=2, max_new_tokens=8)
print("RESULT" + json.dumps(dict(cls=type(model).__module__, ids=ids.tolist())))
"""


def validate_folder(folder: str, model, tokenizer, sentence: str):
    """Load ``folder`` in a fresh offline Python process without hf_hardattn (trust_remote_code) and check that it
    decodes ``sentence`` as ``model`` does here; CommandError naming what failed otherwise."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", VALIDATE_SCRIPT, folder, sentence], capture_output=True, text=True,
                          env=env, cwd=folder, timeout=600)
    if proc.returncode != 0 or "RESULT" not in proc.stdout:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CommandError(f"the upload folder does not load as remote code in a fresh process: {last}")
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    with torch.no_grad():
        here = model.eval().generate(**tokenizer([sentence], return_tensors="pt"), num_beams=2, max_new_tokens=8)
    if result["ids"] != here.tolist():
        raise CommandError(f"the upload folder loaded as remote code decodes {sentence!r} as {result['ids']}, the "
                           f"model here as {here.tolist()}; not pushed.")
    return result


def publish_results(model_dir: str, metrics: dict, command: str | None) -> dict | None:
    """The card's results: the table the model folder already has (``hardattn_results.json``), then the given
    metrics and the command that produced the run."""
    parts, metadata = [], None
    path = os.path.join(model_dir, RESULTS_FILE)
    if os.path.isfile(path):
        with open(path) as handle:
            stored = json.load(handle)
        metadata = stored.pop(CARD_METADATA, None)  # the run's Hub metadata (languages, model-index) stays
        if stored:
            parts.append(stored["table"] if isinstance(stored.get("table"), str) else metrics_table(stored))
    if metrics:
        parts.append(metrics_table(metrics))
    if command:
        parts.append(f"Produced by:\n\n```bash\n{command}\n```")
    results = {"table": "\n\n".join(parts)} if parts else {}
    if metadata:
        results[CARD_METADATA] = metadata
    return results or None


def run_publish(args) -> dict:
    """Build, validate, push (or, with --dry-run OUT, build and validate into OUT)."""
    if args.dry_run is None and huggingface_hub.constants.HF_HUB_OFFLINE:
        raise CommandError("offline: HF_HUB_OFFLINE is set (the command's default), so nothing can be pushed; run "
                           "with HF_HUB_OFFLINE=0 to push, or with --dry-run OUT to build and validate the folder only.")
    if args.dry_run is not None and os.path.exists(args.dry_run) and os.listdir(args.dry_run):
        raise CommandError(f"--dry-run={args.dry_run!r} exists and is not empty; allowed: a new or empty folder.")
    model, tokenizer = load_for_translation(args.model, args.tokenizer)
    if not hasattr(model, "card_title"):
        raise CommandError(f"MODEL={args.model!r} is a {type(model).__name__}, not an hf_hardattn model; push it "
                           f"with its own push_to_hub (publish writes this package's card and code).")
    metrics = {}
    for path in args.results or []:
        try:
            with open(path) as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as error:
            raise CommandError(f"--results={path!r} is not a readable JSON file ({error}).") from error
        rows = loaded if isinstance(loaded, list) else [loaded]  # `hf-hardattn score --json` writes a list
        for row in rows:
            if not isinstance(row, dict):
                raise CommandError(f"--results={path!r}: expected JSON objects, got {type(row).__name__}.")
            if "name" in row and "score" in row:
                metrics[row["name"]] = f"{row['score']} ({row.get('signature', '')})".replace(" ()", "")
            else:
                metrics.update({k: v for k, v in row.items() if isinstance(v, (int, float, str))})
    staging = tempfile.mkdtemp(prefix="publish-")
    try:
        model.save_pretrained(staging, tokenizer=tokenizer)
        results = publish_results(args.model, metrics, args.run_command)
        if results:
            with open(os.path.join(staging, RESULTS_FILE), "w") as handle:
                json.dump(results, handle, indent=2)
        # the card's snippets load the repo pushed to
        write_model_card(model, staging, metadata=dict(model_name=args.repo_id.split("/")[-1]) if results else None,
                         repo_id=args.repo_id)
        validate_folder(staging, model, tokenizer, args.sentence)
        _print(f"validated: {staging} loads as remote code in a fresh offline process and decodes as this model")
        if args.dry_run is not None:
            os.makedirs(args.dry_run, exist_ok=True)
            for name in os.listdir(staging):
                shutil.move(os.path.join(staging, name), os.path.join(args.dry_run, name))
            _print(f"dry run: the upload folder is {args.dry_run}; nothing pushed")
            return dict(folder=args.dry_run, files=sorted(os.listdir(args.dry_run)))
        try:
            info = model.upload_folder_to_hub(staging, args.repo_id, {}, private=args.private or None,
                                        commit_message=args.commit_message or "Upload with hf-hardattn publish")
        except Exception as error:  # network, authentication, permissions: one line, nothing half-done locally
            raise CommandError(f"pushing to {args.repo_id!r} failed: {' '.join(str(error).split())[:300]}") from error
        _print(f"pushed {len(os.listdir(staging))} files to {args.repo_id} in one commit")
        return dict(repo_id=args.repo_id, commit=info)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
def versions() -> str:
    """``hf-hardattn VERSION (torch T, transformers V, Python P)``, from the installed distributions' metadata."""
    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"hf-hardattn {installed('hf-hardattn')} (torch {installed('torch')}, transformers "
            f"{installed('transformers')}, Python {sys.version.split()[0]})")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with ``command`` (what main() does), only that subcommand gets the options
    that its own module defines (distill, train, reproduce: modules loaded on first use), the others their help line."""
    def full(name):
        return command is None or command == name

    parser = argparse.ArgumentParser(prog="hf-hardattn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=versions(),
                        help="print the package's version and those of torch, transformers and Python")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train soft + hard-retrieval models on German noun inflection (CPU, minutes)")
    demo.add_argument("--minutes", type=positive_float, default=6.0,
                      help="total training time, split equally between the two models (default 6)")
    demo.add_argument("--output-dir", default=os.path.join("outputs", "demo"),
                      help="where the two models (with tokenizer and card) and results.json go (default outputs/demo)")
    demo.add_argument("--max-examples", type=positive_int, default=60_000,
                      help="examples taken from the task before splitting by lemma (default 60000)")
    demo.add_argument("--eval-examples", type=positive_int, default=1000, help="test examples scored (default 1000)")
    demo.add_argument("--max-steps", type=positive_int, default=None, help="also stop each model after this many steps")
    demo.add_argument("--batch-size", type=positive_int, default=64, help="training sentences per batch (default 64)")
    demo.add_argument("--eval-batch-size", type=positive_int, default=250, help="sentences per decoding batch (default 250)")
    demo.add_argument("--learning-rate", type=positive_float, default=2e-3, help="peak learning rate (default 2e-3)")
    demo.add_argument("--warmup-steps", type=int, default=200, help="linear warm-up steps (default 200)")
    demo.add_argument("--max-length", type=positive_int, default=64, help="token limit of sources and targets")
    demo.add_argument("--speed-batch", type=positive_int, default=32, help="test inputs decoded for the speed ratio")
    demo.add_argument("--speed-tokens", type=positive_int, default=16, help="new tokens per sentence when timing")
    demo.add_argument("--speed-rounds", type=positive_int, default=3, help="timing rounds of the speed ratio (default 3)")
    demo.add_argument("--show", type=positive_int, default=8, help="example inflections printed")
    demo.add_argument("--threads", type=positive_int, default=1,
                      help="torch CPU threads (default 1: these small models gain little from more, and one thread "
                           "keeps its speed when other programs share the cores)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--tiny", action="store_true", help="tiny models (a smoke test, learns little)")
    demo.set_defaults(func=run_demo)

    tok = sub.add_parser("tokenizer", help="train a joint tokenizer on text files and save it")
    tok.add_argument("--files", nargs="+", required=True, help="text files, one sentence a line (.gz allowed)")
    tok.add_argument("--vocab-size", type=positive_int, default=8000, help="vocabulary size, special tokens included (bpe, "
                     "at least 260; an upper bound for char, at least 5; default 8000)")
    tok.add_argument("--kind", choices=("bpe", "char"), default="bpe", help="byte-level BPE or characters (default bpe)")
    tok.add_argument("--min-frequency", type=positive_int, default=2, help="rarer symbols/merges are left out (default 2)")
    tok.add_argument("--out", required=True, help="output folder (loads with AutoTokenizer.from_pretrained)")
    tok.set_defaults(func=run_tokenizer)

    distill = sub.add_parser("distill", help="sequence-level KD: translate a dataset with a teacher (beam search, "
                                             "resumable shards) into a distilled dataset")
    if full("distill"):  # (a subcommand not named has no options and is not run)
        hf_hardattn_distill.add_distill_arguments(distill)
        distill.set_defaults(func=hf_hardattn_distill.run_distill)

    convert = sub.add_parser(
        "convert", help="map a pretrained MarianMTModel / BART / mBART / M2M100 checkpoint into an hf_hardattn model",
        description="Convert a pretrained translation model into an hf_hardattn model type. soft_transformer "
                    "reproduces the source exactly; the other Transformer types get every parameter they share with "
                    "it, and the report printed lists what was initialised or dropped. The hybrid types (GRU or LSTM "
                    "decoder) are refused: distil the converted soft model into them (hf-hardattn distill). On bad "
                    "input the command exits with a one-line error and writes nothing.")
    convert.add_argument("source", metavar="SRC",
                         help="folder of a MarianMTModel, BartForConditionalGeneration, "
                              "MBartForConditionalGeneration or M2M100ForConditionalGeneration (NLLB); its tokenizer, "
                              "when the folder holds one, is saved with the converted model (a Hub id works with "
                              "HF_HUB_OFFLINE=0: the command runs offline by default)")
    convert.add_argument("out", metavar="OUT", help="output folder, new or empty: weights (safetensors), config, "
                                                    "modeling code (trust_remote_code), model card, tokenizer")
    rnn = " and ".join(sorted(name for name, entry in MODEL_TYPES.items() if entry.rnn_decoder))
    convert.add_argument("--model-type", required=True, metavar="T",
                         help=f"the hf_hardattn model type to convert to: one of {', '.join(sorted(MODEL_TYPES))} "
                              f"({rnn}, with an RNN decoder, are refused with the distillation route)")
    convert.add_argument("--set", action="append", metavar="KEY=VALUE",
                         help="override a field of the target config that the source does not fix (repeatable), "
                              "e.g. --set dropout=0.1 --set recurrent_variant=coverage --set "
                              "'cross_attention=[\"soft\", \"hard_retrieval\"]'; VALUE is parsed as JSON (numbers, "
                              "true/false, null, lists), anything else is taken as a string")
    convert.set_defaults(func=run_convert)

    train = sub.add_parser(
        "train", help="train any model type (or a pretrained / converted checkpoint) on your own parallel data",
        description=(train_cli.__doc__.split("\n\n")[0] + " Bad input ends with a one-line error; see "
                     "hf_hardattn/tools/train_cli.py for the details.") if full("train") else None)
    if full("train"):
        train_cli.add_arguments(train)
        train.set_defaults(func=train_cli.run_train)

    rerun = sub.add_parser("reproduce", help="train and evaluate every variant with one recipe (the papers' "
                                             "tables; resumable) -> JSON + markdown table")
    if full("reproduce"):
        reproduce.add_arguments(rerun)
        rerun.set_defaults(func=reproduce.run)

    tr = sub.add_parser(
        "translate", help="translate a text file (or stdin) with a saved model, one sentence a line",
        description="Translate one sentence a line with any saved seq2seq model (an hf_hardattn type, or a "
                    "MarianMTModel / BART folder). Sources are sorted by length and batched; the output keeps the "
                    "input's order and its empty lines. Prints sentences/s to stderr.")
    tr.add_argument("model", metavar="MODEL", help="saved model folder (its tokenizer beside it, or --tokenizer)")
    tr.add_argument("-i", "--input", default="-", help="text file, one source a line (.gz allowed; default - = stdin)")
    tr.add_argument("-o", "--output", default="-", help="output file (default - = stdout); written once complete")
    tr.add_argument("--tokenizer", default=None, help="tokenizer folder, if not MODEL's")
    tr.add_argument("--num-beams", type=positive_int, default=4, help="beam size (default 4; 1 = greedy)")
    tr.add_argument("--batch-size", type=positive_int, default=64, help="sentences per generate() call (default 64)")
    tr.add_argument("--max-new-tokens", type=positive_int, default=None,
                    help="output limit (default: 1.5 x the batch's source tokens + 10)")
    tr.add_argument("--max-source-tokens", type=positive_int, default=None,
                    help="longest source accepted, in tokens (default: the model's max_position_embeddings); a "
                         "longer line is an error, never truncated")
    tr.add_argument("--do-sample", action="store_true", help="sample instead of searching (with --num-beams > 1: "
                                                             "beam sampling)")
    tr.add_argument("--top-k", type=positive_int, default=None, help="with --do-sample: keep the k likeliest tokens")
    tr.add_argument("--top-p", type=positive_float, default=None, help="with --do-sample: nucleus mass, in (0, 1]")
    tr.add_argument("--temperature", type=positive_float, default=None, help="with --do-sample: softmax temperature")
    tr.add_argument("--seed", type=int, default=0, help="random seed of --do-sample (default 0)")
    tr.add_argument("--pack-linears", action="store_true",
                    help="prepack the linear layers for faster CPU decoding (hf_hardattn models)")
    tr.add_argument("--int8", action="store_true",
                    help="int8 linear layers (model.quantize_int8(): torch's dynamic int8, CPU; hf_hardattn models; "
                         "not with --pack-linears or --dtype bfloat16)")
    tr.add_argument("--int8-engine", choices=("fbgemm", "onednn"), default=None,
                    help="with --int8: the int8 kernels (default fbgemm; onednn: VNNI / AMX kernels where the CPU "
                         "has them, slower on the AVX2 CPU measured)")
    tr.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights' dtype while decoding (bfloat16: CPUs with native bf16)")
    tr.add_argument("--threads", type=positive_int, default=max(1, min(os.cpu_count() or 1, 8)),
                    help="torch CPU threads (default: the cores, at most 8)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar, no speed line")
    tr.set_defaults(func=run_translate)

    score = sub.add_parser(
        "score", help="BLEU / chrF of a hypothesis file against reference files (sacrebleu)",
        description="Corpus BLEU and chrF (sacrebleu) of HYP against one or more reference files, one sentence a line, "
                    "printed with sacrebleu's signature (what to report beside a score).")
    score.add_argument("hypotheses", metavar="HYP", help="hypothesis file (.gz allowed; - = stdin)")
    score.add_argument("references", metavar="REF", nargs="+", help="reference file(s), one line per hypothesis")
    score.add_argument("--metrics", nargs="+", choices=SCORE_METRICS, default=list(SCORE_METRICS),
                       help="metrics (default: bleu chrf)")
    score.add_argument("--tokenize", default="13a", choices=("13a", "intl", "zh", "char", "none"),
                       help="BLEU tokenisation (default 13a, sacrebleu's)")
    score.add_argument("--lowercase", action="store_true", help="case-insensitive scores")
    score.add_argument("--json", action="store_true", help="print JSON (name, score, signature) instead of text")
    score.set_defaults(func=run_score)

    publish = sub.add_parser(
        "publish", help="build, validate (fresh offline process, remote code) and push a model folder to the Hub",
        description="Build the upload folder of a saved hf_hardattn model (weights, config, modeling code, "
                    "tokenizer, and the package's card with the run's metrics and command), check that it loads "
                    "without the package (trust_remote_code) in a fresh offline process and decodes as the model "
                    "here, then push it in one commit. Offline (HF_HUB_OFFLINE=1, this command's default) it "
                    "refuses to push: set HF_HUB_OFFLINE=0, or use --dry-run OUT.")
    publish.add_argument("model", metavar="MODEL", help="saved hf_hardattn model folder (tokenizer beside it)")
    publish.add_argument("repo_id", metavar="REPO_ID", help="Hub repository, user/name (created if needed)")
    publish.add_argument("--tokenizer", default=None, help="tokenizer folder, if not MODEL's")
    publish.add_argument("--results", nargs="+", default=None,
                         help="JSON files of the run's metrics for the card (e.g. `hf-hardattn score --json` output)")
    publish.add_argument("--command", dest="run_command", default=None,
                         help="the exact command that trained the model, for the card")
    publish.add_argument("--sentence", default="A test sentence.", help="what the validation decodes")
    publish.add_argument("--commit-message", default=None, help="the Hub commit's message")
    publish.add_argument("--private", action="store_true", help="create the repository private")
    publish.add_argument("--dry-run", metavar="OUT", default=None,
                         help="build and validate into OUT (new or empty folder); push nothing")
    publish.set_defaults(func=run_publish)

    plot = sub.add_parser(
        "plot", help="attention heat maps of one sentence (PNG), per model and side by side",
        description="Run each MODEL teacher-forced on one sentence pair (the given --target, or the model's greedy "
                    "translation) with output_attentions=True and draw the weights each layer used: "
                    "OUT/NAME_ROLE.png (a row per layer, a column per head and their mean) and, for several models, "
                    "OUT/comparison_ROLE.png (one panel per model: the last layer's head mean; beam-joint models "
                    "show their joint layer with the top-K source positions boxed in red).")
    plot.add_argument("models", metavar="MODEL", nargs="+", help="saved model folder(s) (tokenizer beside each)")
    plot.add_argument("--source", required=True, help="the source sentence")
    plot.add_argument("--target", default=None, help="the target sentence (default: each model's greedy output)")
    plot.add_argument("--role", choices=tuple(ROLES), default="cross",
                      help="which attention (default cross)")
    plot.add_argument("--names", nargs="+", default=None, help="one name per MODEL (default: the folder names)")
    plot.add_argument("--tokenizer", default=None, help="tokenizer folder, if not each MODEL's")
    plot.add_argument("--max-new-tokens", type=positive_int, default=64, help="limit of the greedy translation")
    plot.add_argument("--out", default="attention_plots", help="output folder (default attention_plots)")
    plot.set_defaults(func=run_plot)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((word for word in argv if not word.startswith("-")), "")  # (none for --help / --version)
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # the exact command, for results and cards
    try:
        with offline_by_default():
            args.func(args)
    except (CommandError, ValueError, OSError) as error:
        # the package's input checks raise ValueError / FileNotFoundError naming the parameter, transformers an
        # OSError for a folder that holds no model: one line, status 2
        # (HF_HARDATTN_TRACEBACK=1 shows the traceback instead)
        if os.environ.get("HF_HARDATTN_TRACEBACK") == "1":
            raise
        print(f"hf-hardattn {args.command}: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
