"""The implementations of the ``hf-hardattn`` commands that need the package: ``demo``, ``tokenizer``, ``convert``,
``translate``, ``publish`` and ``plot`` (``train``, ``distill`` and ``reproduce`` are implemented in their own modules).

The command itself (the console script's entry, every light subcommand's parser, ``--version`` and ``score``) is
:mod:`hf_hardattn_cli.command`, outside the package: importing anything of ``hf_hardattn`` loads torch, transformers
and every model file, which ``--help`` and ``score`` do not need. It imports this module when one of these commands
runs and calls its ``run_*`` function with the parsed arguments; bad input raises
:class:`hf_hardattn_cli.arguments.CommandError` (or a ValueError / OSError), which the command prints as one line with
exit status 2.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import huggingface_hub
import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_hardattn_cli.arguments import CommandError
from hf_hardattn_cli.command import read_lines, write_lines

from .. import packed_linear
from ..hard_retrieval import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from ..model_card import CARD_METADATA, RESULTS_FILE, metrics_table, write_model_card
from ..modeling_hardattn import compiled_decoding
from ..registry import ROLES
from ..safe_io import atomic_folder, write_json_atomic
from ..soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from .arguments import assignment, check_model_type, lazy_import
from .convert import convert
from .plot import attention_maps, plot_comparison, plot_layers

# Loaded on first use (``lazy_import``), so that a command loads only the tooling it uses (convert, publish and plot
# no Trainer): the training, data and tokenizer tooling and datasets.
datasets = lazy_import("datasets")
data = lazy_import("hf_hardattn.tools.data")
tokenization = lazy_import("hf_hardattn.tools.tokenization")
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
# translate
# ----------------------------------------------------------------------------------------------------------------
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


CPU_ONLY_OPTIONS = ("int8", "pack_linears")  # translate options that run CPU kernels


def translation_device(args) -> torch.device:
    """The device ``translate`` decodes on: ``--device``, else the accelerator torch sees (a GPU), else the CPU; the
    CPU when --int8 or --pack-linears asks for CPU kernels. Errors name the value and what is allowed."""
    cpu_only = [f"--{name.replace('_', '-')}" for name in CPU_ONLY_OPTIONS if getattr(args, name)]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if args.device is None:
        return torch.device("cpu") if cpu_only or accelerator is None else accelerator
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise CommandError(f"--device={args.device!r} is not a torch device; allowed: cpu, cuda, cuda:N or another "
                           f"accelerator's name ({' '.join(str(error).split())[:120]}).") from None
    if device.type != "cpu":
        if cpu_only:
            raise CommandError(f"{' and '.join(cpu_only)} run CPU kernels, not on --device={args.device}; decode "
                               f"on the CPU (--device cpu) or drop {' and '.join(cpu_only)}.")
        count = torch.accelerator.device_count() if accelerator is not None else 0
        if accelerator is None or accelerator.type != device.type or (device.index or 0) >= count:
            seen = f"{count} {accelerator.type} device(s)" if accelerator is not None else "no accelerator"
            raise CommandError(f"--device={args.device!r} is not available: torch sees {seen}; allowed: cpu"
                               + (f", {accelerator.type}, {accelerator.type}:0 to {count - 1}" if count else "") + ".")
    return device


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
    device = translation_device(args)
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
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
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
    if args.compile:  # static cache + compiled decoding steps (generate() keywords)
        sampling.update(compiled_decoding(model))
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
        threads = torch.get_num_threads()
        where = f"{threads} thread{'s' if threads != 1 else ''}" if device.type == "cpu" else str(device)
        print(f"hf-hardattn translate: {len(todo)} sentences in {seconds:.1f} s, {rate:.2f} sentences/s "
              f"(beam {args.num_beams}, batch {args.batch_size}, {args.dtype}, {where})", file=sys.stderr, flush=True)


def run_plot(args) -> list[str]:
    if args.role not in ROLES:
        raise CommandError(f"--role={args.role!r} is not an attention role; allowed: {', '.join(ROLES)}.")
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
