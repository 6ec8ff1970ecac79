"""The ``hf-hardattn`` command.

* ``hf-hardattn demo``: offline, CPU, a few minutes: train a soft Transformer and a hard-retrieval Transformer on
  German noun inflection (character level), print their held-out exact-match accuracy and greedy decoding speed,
  save both (weights, tokenizer, model card) and reload one through ``AutoModelForSeq2SeqLM``.
* ``hf-hardattn tokenizer --files a.gz b.gz --vocab-size 8000 --out DIR``: train and save a joint tokenizer.
* ``hf-hardattn distill --teacher DIR --data FOLDER --split train --out DIR``: sequence-level knowledge
  distillation, translate a dataset with a teacher (see :mod:`hf_hardattn.tools.distill`).
* ``hf-hardattn convert SRC OUT --model-type T [--set key=value ...]``: map a pretrained Marian / BART / mBART /
  M2M100 checkpoint into an hf_hardattn model type (see :mod:`hf_hardattn.tools.convert`).
* ``hf-hardattn train ...``: train any model type on your own parallel data (see :mod:`hf_hardattn.tools.train_cli`).
* ``hf-hardattn reproduce ...``: every variant with one recipe, the papers' tables (see
  :mod:`hf_hardattn.tools.reproduce`).
* ``hf-hardattn translate MODEL [-i FILE] [-o FILE]``: translate a text file (or stdin) with any saved seq2seq model,
  one sentence a line, batched and length-sorted; prints sentences/s.
* ``hf-hardattn score HYP REF [REF ...]``: BLEU and chrF of a hypothesis file with sacrebleu's signatures.
* ``hf-hardattn publish MODEL REPO_ID``: build the upload folder (weights, tokenizer, code, card with the run's metrics
  and command), validate it by loading it as remote code in a fresh offline process, then push it in one commit.
* ``hf-hardattn plot MODEL [MODEL ...] --source TEXT``: attention heat maps of one sentence (PNG), per model and side
  by side (see :mod:`hf_hardattn.tools.plot`).

Bad input (a missing file, a bad option value, files of different lengths) ends the command with a one-line error
and exit status 2 (``HF_HARDATTN_TRACEBACK=1`` shows the traceback instead). The commands that use the package run
offline unless ``HF_HUB_OFFLINE`` is set (:func:`hf_hardattn.tools.arguments.offline_by_default`).

This module is the console script's entry (:func:`main`), outside the package so that ``--help``, ``--version``,
the ``--help`` of every subcommand but ``train``, ``distill`` and ``reproduce`` (whose options their own modules
define), and ``score`` start without torch, transformers and ``hf_hardattn`` (see :mod:`hf_hardattn_cli`). The other
commands are implemented in :mod:`hf_hardattn.tools.cli`, imported when one of them runs. Names the package owns
(model types, attention roles) are not repeated here: those options take any string, and the command refuses a bad
value, with the allowed list, before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import NamedTuple

from .arguments import CommandError, positive_float, positive_int
from .scores import METRICS, corpus_scores

IMPLEMENTATIONS = "hf_hardattn.tools.cli"  # the commands that need the package


class PackageCommand(NamedTuple):
    """A command implemented in the package, ``hf_hardattn.tools.cli.<name>``: imported when the command runs."""
    name: str

    def __call__(self, args):
        return getattr(importlib.import_module(IMPLEMENTATIONS), self.name)(args)


def _print(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# the text files of translate and score
# ----------------------------------------------------------------------------------------------------------------
def read_lines(path: str, name: str) -> list[str]:
    """The lines of a text file (``.gz`` read through gzip; ``-`` = stdin), without their line ends."""
    if path == "-":
        return [line.rstrip("\n") for line in sys.stdin]
    if not os.path.isfile(path):
        raise CommandError(f"{name}={path!r} is not a file.")
    try:  # (as hf_hardattn.tools.data.read_lines, without loading the package: score starts light)
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


# ----------------------------------------------------------------------------------------------------------------
# score
# ----------------------------------------------------------------------------------------------------------------
def run_score(args) -> list[dict]:
    """sacrebleu's corpus BLEU / chrF of HYP against one or more reference files (same number of lines), computed by
    :func:`hf_hardattn_cli.scores.corpus_scores` as the package's evaluate metric computes them."""
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


# ----------------------------------------------------------------------------------------------------------------
def versions() -> str:
    """``hf-hardattn VERSION (torch T, transformers V, Python P)``, from the installed distributions' metadata (no
    import of torch or transformers)."""
    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"hf-hardattn {installed('hf-hardattn')} (torch {installed('torch')}, transformers "
            f"{installed('transformers')}, Python {sys.version.split()[0]})")


class VersionAction(argparse.Action):
    """``--version``: prints :func:`versions` and exits; the metadata is read only when the option is given."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        _print(versions())
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with ``command`` (what main() does), only that subcommand gets the options
    that its own module defines (distill, train, reproduce: importing them loads the package), the others their help
    line."""
    def full(name):
        return command is None or command == name

    parser = argparse.ArgumentParser(prog="hf-hardattn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=VersionAction,
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
    demo.set_defaults(func=PackageCommand("run_demo"))

    tok = sub.add_parser("tokenizer", help="train a joint tokenizer on text files and save it")
    tok.add_argument("--files", nargs="+", required=True, help="text files, one sentence a line (.gz allowed)")
    tok.add_argument("--vocab-size", type=positive_int, default=8000, help="vocabulary size, special tokens included (bpe, "
                     "at least 260; an upper bound for char, at least 5; default 8000)")
    tok.add_argument("--kind", choices=("bpe", "char"), default="bpe", help="byte-level BPE or characters (default bpe)")
    tok.add_argument("--min-frequency", type=positive_int, default=2, help="rarer symbols/merges are left out (default 2)")
    tok.add_argument("--out", required=True, help="output folder (loads with AutoTokenizer.from_pretrained)")
    tok.set_defaults(func=PackageCommand("run_tokenizer"))

    distill = sub.add_parser("distill", help="sequence-level KD: translate a dataset with a teacher (beam search, "
                                             "resumable shards) into a distilled dataset")
    if full("distill"):  # (a subcommand not named has no options and is not run)
        hf_hardattn_distill = importlib.import_module("hf_hardattn.tools.distill")
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
    convert.add_argument("--model-type", required=True, metavar="T",
                         help="the hf_hardattn model type to convert to, a name of MODEL_TYPES in "
                              "hf_hardattn/registry.py (an unknown name is refused with the list of them; those with "
                              "an RNN decoder are refused with the distillation route)")
    convert.add_argument("--set", action="append", metavar="KEY=VALUE",
                         help="override a field of the target config that the source does not fix (repeatable), "
                              "e.g. --set dropout=0.1 --set recurrent_variant=coverage --set "
                              "'cross_attention=[\"soft\", \"hard_retrieval\"]'; VALUE is parsed as JSON (numbers, "
                              "true/false, null, lists), anything else is taken as a string")
    convert.set_defaults(func=PackageCommand("run_convert"))

    train = sub.add_parser("train", help="train any model type (or a pretrained / converted checkpoint) on your own "
                                         "parallel data")
    if full("train"):
        train_cli = importlib.import_module("hf_hardattn.tools.train_cli")
        train.description = (train_cli.__doc__.split("\n\n")[0] + " Bad input ends with a one-line error; see "
                             "hf_hardattn/tools/train_cli.py for the details.")
        train_cli.add_arguments(train)
        train.set_defaults(func=train_cli.run_train)

    rerun = sub.add_parser("reproduce", help="train and evaluate every variant with one recipe (the papers' "
                                             "tables; resumable) -> JSON + markdown table")
    if full("reproduce"):
        reproduce = importlib.import_module("hf_hardattn.tools.reproduce")
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
    tr.add_argument("--int8-engine", choices=("fbgemm", "onednn", "traced"), default=None,
                    help="with --int8: the int8 kernels (default fbgemm; onednn: VNNI / AMX kernels where the CPU "
                         "has them, slower on the AVX2 CPU measured; traced: int8 layers in torch operators, "
                         "one activation scale per row)")
    tr.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="weights' dtype while decoding (bfloat16: GPUs and CPUs with native bf16; float16: GPUs)")
    tr.add_argument("--device", default=None,
                    help="where to decode: cpu, cuda, cuda:N or another torch accelerator (default: the accelerator "
                         "torch sees, else cpu; cpu with --int8 or --pack-linears, which are CPU kernels)")
    tr.add_argument("--compile", action="store_true",
                    help="static cache and compiled decoding steps (torch.compile; the first batches pay the compile, "
                         "tens of seconds; soft and hard-retrieval models, MarianMTModel / BART; not with --int8 or "
                         "--pack-linears)")
    tr.add_argument("--threads", type=positive_int, default=max(1, min(os.cpu_count() or 1, 8)),
                    help="torch CPU threads (default: the cores, at most 8)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar, no speed line")
    tr.set_defaults(func=PackageCommand("run_translate"))

    score = sub.add_parser(
        "score", help="BLEU / chrF of a hypothesis file against reference files (sacrebleu)",
        description="Corpus BLEU and chrF (sacrebleu) of HYP against one or more reference files, one sentence a line, "
                    "printed with sacrebleu's signature (what to report beside a score).")
    score.add_argument("hypotheses", metavar="HYP", help="hypothesis file (.gz allowed; - = stdin)")
    score.add_argument("references", metavar="REF", nargs="+", help="reference file(s), one line per hypothesis")
    score.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS),
                       help=f"metrics (default: {' '.join(METRICS)})")
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
    publish.set_defaults(func=PackageCommand("run_publish"))

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
    plot.add_argument("--role", default="cross", metavar="ROLE",
                      help="which attention, a name of ROLES in hf_hardattn/registry.py (default cross; an unknown "
                           "name is refused with the list of them)")
    plot.add_argument("--names", nargs="+", default=None, help="one name per MODEL (default: the folder names)")
    plot.add_argument("--tokenizer", default=None, help="tokenizer folder, if not each MODEL's")
    plot.add_argument("--max-new-tokens", type=positive_int, default=64, help="limit of the greedy translation")
    plot.add_argument("--out", default="attention_plots", help="output folder (default attention_plots)")
    plot.set_defaults(func=PackageCommand("run_plot"))
    return parser


def main(argv=None) -> int:
    """The console script ``hf-hardattn``: parse ``argv`` (default: the process's arguments), run the command, return
    its exit status (0, or 2 after a one-line error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((word for word in argv if not word.startswith("-")), "")  # (none for --help / --version)
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # the exact command, for results and cards
    try:
        if args.func is run_score:  # the front's own command: no package, nothing on the Hub
            offline = contextlib.nullcontext()
        else:
            offline = importlib.import_module("hf_hardattn.tools.arguments").offline_by_default()
        with offline:
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
