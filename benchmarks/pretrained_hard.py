"""From a trained MarianMTModel to a fine-tuned hard-retrieval model: BLEU and decoding speed.

The workflow of a user with an opus-mt checkpoint, measured on Multi30k en-de. ``--source`` is a MarianMTModel (or
BART / mBART / M2M100) folder holding its tokenizer, by default the ``marian`` row trained by ``python
benchmarks/reproduce.py --task multi30k --preset small --rows marian --threads 1 --output-dir
outputs/reproduce/multi30k-small-marian`` (the ``small`` preset: d_model 128, 20 minutes of fp32 training; on an idle
machine ``--preset cpu`` gives the d_model-256 35-minute row, then pass ``--preset cpu`` here too). Scored (BLEU of
beam 4 on test_2016_flickr, as the reproduction table scores):

* ``source``: the source model itself;
* ``soft``: ``hf_hardattn.convert(source, "soft_transformer")``, which must translate exactly as the source (the JSON
  stores whether every output is identical);
* ``hard``: ``convert(source, "hard_retrieval_transformer")``, hard retrieval in decoder self- and cross-attention
  decoded with no training (the hard-retrieval paper's Table 4: soft-trained, decoded hard);
* ``hard_ftN``: that model after N steps of fine-tuning with hard retrieval (sampled + straight-through);
* ``soft_ftN``: the control, the soft model after the same N steps (a source trained briefly gains from more steps
  whatever its attention; each ``*_ftN`` row is compared with it too);
* ``hc_sa``, ``hc_sa_ftN``: ``convert(source, "gaussian_transformer")`` with ``GaussianConfig.preset("hc-sa")``'s
  kinds (Gaussian encoder and decoder self-attention, which keep the value and output projections and drop query
  and key; soft cross-attention), with no training and after N steps.

Fine-tuning: ``train_seq2seq`` with the reproduction recipe's batches (``max_tokens`` / mean length), precision and
label smoothing (``--preset``), Adam at ``--learning-rate`` after ``--warmup-steps`` of linear warm-up, then
constant: one run per model, scored at each N of ``--steps`` on a copy of the weights (decoded in fp32, with the
random state restored), so the score at N does not depend on the other N asked for.

Decoding speed, at the end and in this one process: every model of ``--speed-models`` decodes the test set at beam 4
(batch 64, free length: what the BLEU run decodes) and a batch of 64 test sentences with the length forced to 30 new
tokens (``training.decode_speed``), model after model, for ``--speed-rounds`` rounds; the medians are reported,
with the load averages seen before and after. ``--speed-forced-only`` skips the test-set rounds (then each row's
test-set speed is the one timing of its scoring run).

    python benchmarks/pretrained_hard.py --threads 1 --results benchmarks/results/pretrained_hard_NAME

Writes RESULTS.json (every row, the command, the machine) and RESULTS.md (the tables); the fine-tuned models (with
the tokenizer) go to ``--output-dir``/models.
"""

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, TrainerCallback

import hf_hardattn
from hf_hardattn.gaussian import GaussianConfig
from hf_hardattn.tools.recipes import PRESETS
from hf_hardattn.tools.reproduce import batch_size_for, evaluate, load_task
from hf_hardattn.tools.training import check_bf16, decode_speed, machine, tokenize_dataset, train_seq2seq, translate

DEFAULT_SOURCE = "outputs/reproduce/multi30k-small-marian/models/marian"
ROLES = ("encoder_attention", "decoder_attention", "cross_attention")
TARGETS = {  # row name -> (model_type, attention kinds); hard_retrieval_transformer's defaults are decoder self + cross
    "hard": ("hard_retrieval_transformer", dict(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")),
    "soft": ("soft_transformer", {}),  # the control: what the same fine-tuning steps give the soft model
    "hc_sa": ("gaussian_transformer", {role: getattr(GaussianConfig.preset("hc-sa"), role) for role in ROLES}),
}


class ScoreAt(TrainerCallback):
    """Calls ``score(model, step)`` after the optimizer steps in ``steps``."""

    def __init__(self, steps, score):
        self.steps, self.score = set(steps), score

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.steps:
            self.score(model, state)


def snapshot(model):
    """A copy of ``model``'s weights in a fresh instance (the trainer's model runs its forward under accelerate's bf16
    autocast wrapper; the copy decodes in fp32), built without moving the training's random state."""
    with torch.random.fork_rng(devices=[]):
        return model.with_attention().eval()


def score_row(rows, name, model, ctx, **extra):
    start = time.perf_counter()
    with torch.autocast("cpu", enabled=False):
        result = evaluate("multi30k", model, ctx["tokenizer"], ctx["test"], ctx["recipe"], return_hypotheses=True)
    row = dict(row=name, model_type=model.config.model_type, **extra, **result)
    rows[name] = row
    print(f"[{name}] BLEU {row['score']:.2f} ({time.perf_counter() - start:.0f} s to score)", flush=True)
    write_results(ctx, rows)
    return row


def fine_tune(target, model, rows, ctx):
    """Fine-tune ``model`` for max(steps), scoring it at each of ``steps``; returns the trained model."""
    args, recipe = ctx["args"], ctx["recipe"]
    scoring = []  # seconds spent scoring, not training

    def score(trained, state):
        start = time.perf_counter()
        losses = [log["loss"] for log in state.log_history if "loss" in log]
        train_seconds = time.perf_counter() - began - sum(scoring)
        score_row(rows, f"{target}_ft{state.global_step}", snapshot(trained), ctx, steps=state.global_step,
                  train_minutes=round(train_seconds / 60, 2), last_train_loss=losses[-1] if losses else None,
                  load_average=[round(x, 2) for x in os.getloadavg()])
        scoring.append(time.perf_counter() - start)

    began = time.perf_counter()
    torch.manual_seed(args.seed)
    trainer = train_seq2seq(model, ctx["tokenizer"], ctx["train_tok"], output_dir=os.path.join(args.output_dir,
                            "trainer", target), max_steps=max(args.steps), batch_size=ctx["batch_size"],
                            learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                            lr_scheduler="constant_with_warmup", bf16=recipe.bf16, seed=args.seed,
                            logging_steps=min(50, min(args.steps)), progress=not args.quiet,
                            callbacks=[ScoreAt(args.steps, score)])
    trained = trainer.model.eval()
    folder = os.path.join(args.output_dir, "models", f"{target}_ft{max(args.steps)}")
    trained.save_pretrained(folder, tokenizer=ctx["tokenizer"])
    return trained


def measure_speed(models, ctx):
    """Median sentences/s per model: the test set at beam 4 (free length) and 64 test sentences forced to 30 new
    tokens, alternating model after model for ``--speed-rounds`` rounds (after one untimed warm-up pass each)."""
    args, recipe, tokenizer = ctx["args"], ctx["recipe"], ctx["tokenizer"]
    sources = list(ctx["test"]["source"])
    forced = tokenizer(sources[: recipe.eval_batch_size], max_length=recipe.max_length, truncation=True,
                       padding=True, return_tensors="pt")
    timings = {name: dict(test_set=[], forced=[]) for name in models}
    load_before = [round(x, 2) for x in os.getloadavg()]
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        for name, model in models.items():  # warm-up
            decode_speed(model, forced["input_ids"], forced["attention_mask"], num_beams=recipe.num_beams,
                         new_tokens=30, repeats=1, warmup=0)
        for round_index in range(args.speed_rounds):
            for name, model in models.items():
                if not args.speed_forced_only:
                    start = time.perf_counter()
                    hypotheses = translate(model, tokenizer, sources, num_beams=recipe.num_beams,
                                           batch_size=recipe.eval_batch_size, max_length=recipe.max_length)
                    timings[name]["test_set"].append(len(sources) / (time.perf_counter() - start))
                    if hypotheses != ctx["rows"][name]["hypotheses"]:
                        raise RuntimeError(f"{name}: the timed decoding differs from the scored one")
                timings[name]["forced"].append(decode_speed(
                    model, forced["input_ids"], forced["attention_mask"], num_beams=recipe.num_beams, new_tokens=30,
                    repeats=1, warmup=0))
            print(f"speed round {round_index + 1}/{args.speed_rounds} (test set / forced): " + ", ".join(
                f"{n} {t['test_set'][-1] if t['test_set'] else float('nan'):.1f}/{t['forced'][-1]:.1f}"
                for n, t in timings.items()), flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    speed = {}
    for name, t in timings.items():
        test_set = round(statistics.median(t["test_set"]), 2) if t["test_set"] else None  # None: --speed-forced-only
        speed[name] = dict(test_set_sentences_per_s=test_set,
                           forced_sentences_per_s=round(statistics.median(t["forced"]), 2),
                           test_set_rounds=[round(x, 2) for x in t["test_set"]],
                           forced_rounds=[round(x, 2) for x in t["forced"]])
    return dict(models=speed, rounds=args.speed_rounds, load_average_before=load_before, load_average_after=load_after,
                test_set=f"{len(sources)} sentences, beam {recipe.num_beams}, batch {recipe.eval_batch_size}, "
                         f"free length (1.5 x source + 10 at most)",
                forced=f"the first {forced['input_ids'].shape[0]} test sentences in one batch, beam "
                       f"{recipe.num_beams}, 30 new tokens")


def recovery(rows, target, soft_bleu):
    """The first fine-tuning step count whose BLEU is within 0.5 of the soft model's, or None."""
    tuned = sorted((row["steps"], row["score"]) for name, row in rows.items() if name.startswith(f"{target}_ft"))
    return next((steps for steps, bleu in tuned if bleu >= soft_bleu - 0.5), None)


def markdown(ctx, rows, speed):
    soft = rows.get("soft", {}).get("score")
    lines = ["| row | model_type | fine-tuning steps | BLEU | vs soft | vs soft_ftN | training min | "
             "sentences/s, test set (its scoring run) | sentences/s, test set (speed rounds) | "
             "sentences/s, forced 30 tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in rows.items():
        s = (speed or {}).get("models", {}).get(name)
        delta = f"{row['score'] - soft:+.2f}" if soft is not None and name != "soft" else ""
        control = rows.get(f"soft_ft{row['steps']}") if row["steps"] and not name.startswith("soft") else None
        versus_control = f"{row['score'] - control['score']:+.2f}" if control else ""
        lines.append(f"| {name} | {row['model_type']} | {row['steps']} | {row['score']:.2f} | {delta} | "
                     f"{versus_control} | {row.get('train_minutes', '')} | {row['sentences_per_s']} | "
                     f"{(s['test_set_sentences_per_s'] or '') if s else ''} | "
                     f"{s['forced_sentences_per_s'] if s else ''} |")
    return "\n".join(lines)


def write_results(ctx, rows, speed=None):
    args = ctx["args"]
    soft = rows.get("soft", {}).get("score")
    payload = dict(
        command=ctx["command"], machine=machine(), source=args.source, preset=args.preset,
        fine_tuning=dict(learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                         schedule="constant_with_warmup", batch_size=ctx["batch_size"], bf16=ctx["recipe"].bf16,
                         label_smoothing=ctx["recipe"].label_smoothing, seed=args.seed, steps=args.steps),
        recovered_within_half_bleu_at={target: recovery(rows, target, soft) for target in args.targets
                                       if target != "soft"} if soft is not None else None,
        rows={name: {k: v for k, v in row.items() if k != "hypotheses"} for name, row in rows.items()}, speed=speed)
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results + ".json.tmp", "w") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(args.results + ".json.tmp", args.results + ".json")
    with open(args.results + ".md", "w") as handle:
        handle.write(f"# From a pretrained checkpoint to hard retrieval\n\n`{ctx['command']}`\n\n"
                     f"{markdown(ctx, rows, speed)}\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="a MarianMTModel / BART / mBART / M2M100 folder "
                                                                 "holding its tokenizer")
    parser.add_argument("--data", default=None, help="a folder of {train,test_2016_flickr}.{en,de}[.gz] (default "
                                                     "../shared/data/multi30k)")
    parser.add_argument("--preset", choices=sorted(PRESETS["multi30k"]), default="small",
                        help="the Multi30k recipe whose batches, precision, label smoothing and scoring are used")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="override the preset's")
    parser.add_argument("--eval-size", type=int, default=None, help="override the preset's number of test examples")
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS),
                        help="models to fine-tune, in this order (soft: the control)")
    parser.add_argument("--steps", nargs="+", type=int, default=[50, 100, 200, 300, 500, 1000],
                        help="fine-tuning step counts to score at (one run per target, to the largest)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--speed-rounds", type=int, default=3, help="0: no speed measurement")
    parser.add_argument("--speed-forced-only", action="store_true",
                        help="time only the forced-length batch (the test-set sentences/s is then the one timing of "
                             "each row's scoring, the row's sentences_per_s)")
    parser.add_argument("--speed-models", nargs="+", default=None, metavar="ROW",
                        help="rows to time (default: source, soft, and each other target untrained and at the "
                             "largest N)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=os.path.join("outputs", "pretrained_hard"))
    parser.add_argument("--results", default=None, help="path without extension: writes RESULTS.json and RESULTS.md "
                        "(default benchmarks/results/pretrained_hard_KIND, KIND the CPU kind: "
                        "benchmarks/machine_kind.py)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.results is None:
        from machine_kind import machine_kind  # beside this script (a test loads the script by its path)
        args.results = os.path.join("benchmarks", "results", f"pretrained_hard_{machine_kind()}")
    if any(n < 1 for n in args.steps):
        parser.error(f"--steps must be positive integers, got {args.steps}")
    args.steps = sorted(set(args.steps))
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    for name in ("warmup_steps", "speed_rounds"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.eval_size is not None and args.eval_size < 1:
        parser.error(f"--eval-size must be >= 1, got {args.eval_size}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not os.path.isfile(os.path.join(args.source, "config.json")):
        parser.error(f"--source {args.source!r} is not a model folder (no config.json); train one with "
                     f"benchmarks/reproduce.py --rows marian (see this script's help)")
    rows = ["source", "soft", *args.targets, *(f"{t}_ft{max(args.steps)}" for t in args.targets)]
    args.speed_models = args.speed_models or [name for name in dict.fromkeys(rows)
                                              if name != f"soft_ft{max(args.steps)}"]
    unknown = [name for name in args.speed_models if name not in rows]
    if unknown:
        parser.error(f"--speed-models {unknown} are not rows of this run; allowed: {rows}")
    return args


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = copy.deepcopy(PRESETS["multi30k"][args.preset])
    if args.precision is not None:
        recipe.bf16 = args.precision == "bf16"
    if args.eval_size is not None:
        recipe.eval_size = args.eval_size
    check_bf16(recipe.bf16, name=f"--preset {args.preset}", fix="Pass --precision fp32")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.source)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--source {args.source!r} holds no tokenizer ({error}); save it beside the model") from error
    source = AutoModelForSeq2SeqLM.from_pretrained(args.source).eval()
    train, test = load_task("multi30k", recipe, args.data, args.seed)
    train_tok = tokenize_dataset(train, tokenizer, max_length=recipe.max_length)
    _, batch_size = batch_size_for(recipe, train_tok)
    ctx = dict(args=args, recipe=recipe, tokenizer=tokenizer, test=test, train_tok=train_tok, batch_size=batch_size,
               command="python benchmarks/pretrained_hard.py " + shlex.join(argv))
    rows = ctx["rows"] = {}
    print(f"{args.source}: {type(source).__name__}, {len(train)} training examples, {len(test)} test, "
          f"{batch_size} sentences per batch", flush=True)

    models = {"source": source}
    score_row(rows, "source", source, ctx, steps=0)
    models["soft"], report = hf_hardattn.convert(source, "soft_transformer", label_smoothing=recipe.label_smoothing,
                                                 return_report=True)
    soft = score_row(rows, "soft", models["soft"], ctx, steps=0, exact_conversion=report.exact)
    soft["identical_to_source"] = soft["hypotheses"] == rows["source"]["hypotheses"]  # the conversion's check
    for target in args.targets:
        model_type, kinds = TARGETS[target]
        if target != "soft":  # soft: converted and scored above
            model, report = hf_hardattn.convert(source, model_type, label_smoothing=recipe.label_smoothing, **kinds,
                                                return_report=True)
            models[target] = model.eval()
            score_row(rows, target, model, ctx, steps=0, initialised=report.initialised, dropped=report.dropped)
        models[f"{target}_ft{max(args.steps)}"] = fine_tune(target, copy.deepcopy(models[target]), rows, ctx)
    speed = None
    if args.speed_rounds:
        speed = measure_speed({name: models[name] for name in args.speed_models}, ctx)
    write_results(ctx, rows, speed)
    print(markdown(ctx, rows, speed), flush=True)
    return rows


if __name__ == "__main__":
    main()
