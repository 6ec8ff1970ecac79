"""One reproducible table for every variant: train with one shared recipe, evaluate, write JSON + markdown.

Tooling, not runtime code. ``python benchmarks/reproduce.py`` and ``hf-hardattn reproduce`` run :func:`main`.

Tasks
    * ``multi30k``: En->De translation from a folder of parallel text files (default ``../shared/data/multi30k``,
      ``--data``), joint BPE tokenizer trained here, BLEU of beam 4 on ``test_2016_flickr`` (sacrebleu on
      detokenised text; the signature is stored), and BLEU and chrF on every scored set: ``test_2016_flickr`` and
      the validation split ``val`` (never used to choose a checkpoint here), in the row's ``scores`` / ``chrf``.
    * ``nouns``: German noun inflection (the ``german-nouns`` package, character level), exact-match accuracy of
      beam 4 on a fixed sample of held-out lemmas.

Presets
    * ``cpu``: sizes that train on 2 CPU cores. Multi30k: d_model 256, 3+3 layers, 4 heads, FFN 1024, BPE 8k, Adam
      lr 5e-4, 1000 warm-up steps then linear decay to 0 at the end of the time budget, label smoothing 0.1,
      ~4k-token batches, bf16 autocast (fp32 weights; AMX makes its GEMMs 3x faster), 35 minutes per row (the budget
      of the ``transformers.MarianMTModel`` reference row ``marian``, trained with the same recipe). Nouns: d_model
      128, 2+2 layers, inverse-square-root schedule, fp32, 3 minutes per row. bf16 needs a CPU with AVX512 or AMX
      (or a GPU): elsewhere its GEMMs run ~100x slower than fp32, so the preset refuses to start and
      ``--precision fp32`` trains in fp32 instead. Rows trained for a number of minutes compare only with rows of
      the same machine and precision: every row stores its ``machine`` (CPU, bf16 support, threads, torch, GPU).
    * ``small``: for a shared or slow CPU. Multi30k: the nouns ``cpu`` sizes (d_model 128, 2+2 layers, 4 heads, FFN
      512), BPE 8k, ~1k-token batches, fp32, Adam lr 1e-3, 200 warm-up steps then linear decay to 0 at the end of
      20 minutes per row (run with ``--threads 1`` on shared cores). Nouns: the same as ``cpu``.
    * ``base``: the papers' Transformer-base sizes (d_model 512, 6+6, 8 heads, FFN 2048) for a GPU, by steps.
    * ``tiny``: d_model 32, a few steps, a few test sentences: checks the pipeline in seconds, learns nothing.

Recipes (``--recipe``): ``today`` (default), the preset's for every row; or a paper's on the preset's sizes
(``recipes.PAPER_RECIPES``; results in ``reproduce_TASK_PRESET_RECIPE.json``) for that paper's rows alike, the baseline
included: ``hard_retrieval`` (Lipschitz init, attention dropout 0.1 before the draw, the average of the last 5
checkpoints), ``hybrid`` (GRU 2 x d_model wide, each ``hybrid_*`` row trained with at least the teacher's steps and
continued by its Eq. 1 row, KD data of beam 12, the Eq. 1 stage stopped by the validation BLEU), ``beam_joint``
(dropout 0.2, label smoothing 0). Each trains to convergence (``recipes.CONVERGENCE``; cpu preset: validation loss
every 250 steps, patience 5, cap 12000 steps) with the inverse-square-root schedule.

Convergence (``--patience N --eval-steps E``, any recipe): every E steps the validation split's loss (``val_loss``:
teacher-forced NLL per token, no label smoothing) or BLEU (``--patience-metric val_bleu``) is measured; a KD row's stage
2, which learns the teacher's translations, may use another (``--kd-patience-metric``; ``hybrid``: BLEU). A row stops
once N evaluations in a row have not improved on its best, or at the cap (``--max-steps``, ``--minutes``). The row
stores ``converged``, ``steps`` (reached) and ``convergence`` (the rule and its curve [[step, value], ...]; per stage
for the two-stage rows). The validation split then decides when a row stops; test_2016_flickr stays untouched.

Rows (``--rows``, default all): see :data:`ROWS`. A row that decodes another row's model differently (e.g.
``soft_decoded_hard``) or learns from its translations (``hybrid_*_kd``, ``hybrid_*_kd_eq1``) runs that row first, as an
Eq. 1 row under the ``hybrid`` recipe runs its ``hybrid_*`` row. KD rows name their stage-2 objective
(``hf_hardattn.tools.distill`` ``kd_scheme``): ``hybrid_*_kd`` are sequence-level KD only, not the hybrid paper's Eq. 1
(``sequence_only``: trained from scratch on the soft row's beam-4 translations, no reference term, no MLE stage);
``hybrid_*_kd_eq1`` are Eq. 1 with the paper's two stages (``eq1_sequence``: MLE on the references, then reference NLL +
lambda * NLL of the teacher's translation, lambda 1; today's recipe gives each stage half the row's budget and a new
optimizer running the preset's schedule compressed onto its half, warm-up halved too; the ``hybrid`` recipe's MLE stage
is the ``hybrid_*`` row itself, trained with at least the teacher's steps, whose weights, optimizer and schedule Eq. 1
continues: ``recipes.MLE_STAGES``). The teacher's translations are kept in ``--results-dir`` (:func:`kd_data`), so that
a later run in a fresh output folder trains these rows without training the teacher again. The beam-joint rows and
``rnn_luong_soft`` (their soft baseline on the same Luong-style LSTM decoder) train with label smoothing 0, the
beam-joint paper's plain likelihood (the ``*_bahdanau`` rows keep the earlier recipe: the hybrid's GRU decoder, label
smoothing 0.1). Finished rows are stored in ``reproduce_TASK_PRESET.json`` in the output folder and skipped on a rerun
(``--force`` redoes them; a --force rerun cut off part-way resumes with --force), so a run can be interrupted and
resumed (a row trained by steps, as under every paper recipe, also resumes part-way from its last checkpoint:
:func:`prepare_trainer_dir`, ``distill.train_two_stage(resume_from_checkpoint=True)``), and two processes may run
disjoint sets of rows into the same output folder (e.g. one thread each for the small nouns models; train the tokenizer
first) or, each from its own output folder, into the same ``--results-dir`` (each write keeps the rows the other has
written there). Every row stores the command that produced it, its seed, the recipe (``recipe_name`` and every field of
:class:`Recipe`) and the training settings its model was built with (``model_fields``: sizes, dropouts, label smoothing,
init, dropout placement, RNN widths), so that no override goes unrecorded. ``--export-fp16 DIR`` also keeps each trained
row's final model in fp16 with its tokenizer and card.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import sys
import time

import datasets
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel

from hf_hardattn_cli.scores import corpus_scores

from ..beam_joint import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                          BeamJointTransformerForConditionalGeneration)
from ..gaussian import GaussianConfig, GaussianForConditionalGeneration, length_ratio_unless_given
from ..hard_retrieval import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from ..hybrid import HybridConfig, HybridForConditionalGeneration
from ..model_card import RESULTS_FILE, write_model_card
from ..recurrent import RecurrentConfig, RecurrentForConditionalGeneration
from ..safe_io import atomic_folder, write_json_atomic, write_text_atomic
from ..soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from . import checkpointing, distill, training
from .data import german_nouns, load_parallel, multi30k
from .recipes import PAPER_RECIPES, PRESET_NAMES, RECIPE_NAMES, TASKS, Recipe, recipe_for
from .tokenization import train_tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    name: str
    paper: str  # where the paper reports it
    expect: str  # the paper's direction, to compare with
    build: object = None  # (ctx) -> model, for a trained row
    source: str | None = None  # a row whose trained model this row decodes differently ...
    derive: object = None  # ... with derive(model) -> model
    kd_scheme: str | None = None  # hf_hardattn.tools.distill kd_scheme: learn from the soft teacher's beam-4 translations
    two_stage: bool = False  # with kd_scheme: MLE on the references first (the paper's stage 1; budget: mle_stage)
    mle_row: str | None = None  # two_stage under the recipe's mle_stage "row": the row whose training is stage 1
    tasks: tuple = TASKS
    baseline: str = "soft"  # the row the paper's direction compares with (the table's "vs" column)

    @property
    def kd(self) -> bool:
        return self.kd_scheme is not None


def _special(tokenizer):
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id)


def _common(ctx, **extra):
    """The recipe's model fields (sizes, special tokens, label smoothing, positions); ``extra`` adds or overrides."""
    recipe = ctx["recipe"]
    common = dict(**recipe.dims, **_special(ctx["tokenizer"]), label_smoothing=recipe.label_smoothing,
                  max_position_embeddings=max(256, recipe.max_length))
    if recipe.embed_init_std != "model":  # the recipe's embeddings init (nouns: None)
        common["embed_init_std"] = recipe.embed_init_std
    if recipe.init_std != "model":  # a paper's init (hard retrieval: "lipschitz")
        common["init_std"] = recipe.init_std
    if recipe.attention_dropout is not None:
        common["attention_dropout"] = recipe.attention_dropout
    if "init_std" in ctx:  # --init-std: every hf_hardattn row's initialisation (marian keeps its own, N(0, 0.02))
        common["init_std"] = ctx["init_std"]
    if "embed_init_std" in ctx:  # --embed-init-std (or None under --init-std alone): the embeddings' std
        common["embed_init_std"] = ctx["embed_init_std"]
    common.update(extra)
    return common


def _soft(**kinds):
    def build(ctx):
        return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**_common(ctx, **kinds)))
    return build


def _hard(**kinds):
    def build(ctx):
        placement = ctx["recipe"].retrieval_dropout  # where attention dropout acts (None: the config's default)
        extra = dict(kinds, **({} if placement is None else dict(retrieval_dropout=placement)))
        return HardRetrievalForConditionalGeneration(HardRetrievalConfig(**_common(ctx, **extra)))
    return build


def _gaussian(preset):
    def build(ctx):
        config = GaussianConfig.preset(preset, **_common(ctx))
        # hc-all: gamma of the training corpus, or a given one (e.g. for speed benchmarks)
        length_ratio_unless_given(config, ctx["train"], ctx["tokenizer"], given=ctx.get("length_ratio"))
        return GaussianForConditionalGeneration(config)
    return build


def _rnn_common(ctx, **extra):
    common = _common(ctx, **extra)
    common.update(ctx["recipe"].rnn, decoder_layers=1)
    return common


def _hybrid(attention, **extra):
    def build(ctx):
        return HybridForConditionalGeneration(HybridConfig(**_rnn_common(ctx, rnn_attention=attention, **extra)))
    return build


# The beam-joint paper's RNN decoder (beam_joint_rnn's defaults): Luong-style LSTM with input feeding, dot attention.
# Its rows and their soft baseline train with plain likelihood, as the paper (tensorflow/nmt has no label smoothing).
PAPER_RNN = dict(rnn_decoder_style="luong", rnn_cell="lstm", rnn_attention="dot")
# The earlier beam-joint RNN rows (``*_bahdanau``): the hybrid's Bahdanau-style GRU decoder, label smoothing 0.1.
EARLIER_RNN = dict(rnn_decoder_style="bahdanau", rnn_cell="gru", rnn_attention="additive", label_smoothing=None)


def _recurrent(variant):
    def build(ctx):
        return RecurrentForConditionalGeneration(RecurrentConfig(**_common(ctx, recurrent_variant=variant)))
    return build


def _beam_joint(setting, **joint):
    """A beam-joint row: label smoothing 0 (the paper's plain likelihood; the other rows take the recipe's) unless
    ``label_smoothing=None`` asks for the recipe's."""
    def build(ctx):
        fields = dict(joint)
        if fields.setdefault("label_smoothing", 0.0) is None:
            del fields["label_smoothing"]
        if setting == "rnn":
            return BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**_rnn_common(ctx, **fields)))
        return BeamJointTransformerForConditionalGeneration(BeamJointTransformerConfig(**_common(ctx, **fields)))
    return build


def _marian(ctx):
    recipe = ctx["recipe"]
    dims = {k: v for k, v in recipe.dims.items() if k != "dropout"}
    config = MarianConfig(**dims, **_special(ctx["tokenizer"]), dropout=recipe.dims["dropout"],
                          activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
                          forced_eos_token_id=None, max_position_embeddings=max(256, recipe.max_length))
    return MarianMTModel(config)


def _with_attention(**kinds):
    return lambda model: model.with_attention(**kinds)


def _inference_k(k):
    def derive(model):
        model = copy.deepcopy(model)
        model.config.joint_inference_k = k
        return model
    return derive


HARD = "hard_retrieval"
ROWS = [
    Row("marian", "reference", "transformers.MarianMTModel, same size and recipe: soft should match or beat it",
        build=_marian),
    Row("soft", "baseline", "baseline", build=_soft()),
    Row("hard_cross", "hard retrieval, Table 3", "within 0.5 BLEU of soft", build=_hard(decoder_attention="soft")),
    Row("hard_self_cross", "hard retrieval, Table 3", "within 0.5 BLEU of soft", build=_hard()),
    Row("hard_enc_dec", "hard retrieval, Table 3", "a larger drop than decoder-only",
        build=_hard(encoder_attention=HARD)),
    Row("soft_decoded_hard", "hard retrieval, Table 4", "a clear drop (paper: 27.55 -> 26.30)",
        source="soft", derive=_with_attention(decoder_attention=HARD, cross_attention=HARD)),
    Row("hard_decoded_soft", "hard retrieval, Table 4", "no drop (paper: 27.73 -> 27.80)",
        source="hard_self_cross", derive=_with_attention(decoder_attention="soft", cross_attention="soft"),
        baseline="hard_self_cross"),
    Row("hc_sa", "hard-coded Gaussian, Table 2", "about equal to soft", build=_gaussian("hc-sa")),
    Row("hc_all", "hard-coded Gaussian, Table 2", "far below soft", build=_gaussian("hc-all")),
    Row("sh_x", "hard-coded Gaussian, Table 2", "1-3 BLEU below soft", build=_gaussian("sh-x")),
    *[Row(f"hybrid_{a}", "hybrid, Tables 2-3", "below the Transformer teacher", build=_hybrid(a))
      for a in ("additive", "dot", "multihead")],
    *[Row(f"hybrid_{a}_kd", "hybrid + KD, Tables 2-3; here sequence-level KD only, not Eq. 1 (teacher outputs "
          "from scratch: no reference term, no MLE stage)", "close to the soft teacher, above hybrid without KD",
          build=_hybrid(a), kd_scheme="sequence_only") for a in ("additive", "dot", "multihead")],
    *[Row(f"hybrid_{a}_kd_eq1", "hybrid + KD, Tables 2-3: Eq. 1, two stages (MLE, then reference NLL + NLL of the "
          "teacher's output; budgets: the recipe's mle_stage)", "close to the soft teacher, above hybrid without KD",
          build=_hybrid(a), kd_scheme="eq1_sequence", two_stage=True, mle_row=f"hybrid_{a}")
      for a in ("additive", "dot", "multihead")],
    Row("rnn_luong_soft", "beam-joint, Table 1 (soft attention on the paper's LSTM decoder)",
        "baseline of beam_joint_rnn_k6 (same decoder, soft attention)",
        build=_hybrid(PAPER_RNN["rnn_attention"], label_smoothing=0.0,
                      **{k: v for k, v in PAPER_RNN.items() if k != "rnn_attention"}), baseline="rnn_luong_soft"),
    Row("beam_joint_rnn_k6", "beam-joint, Table 1 (the paper's setting: Luong-style LSTM, input feeding)",
        "above rnn_luong_soft (soft)", build=_beam_joint("rnn", joint_k=6, **PAPER_RNN), baseline="rnn_luong_soft"),
    Row("beam_joint_rnn_k6_decoded_k1", "beam-joint, Table 2", "below K=6, still above rnn_luong_soft (soft)",
        source="beam_joint_rnn_k6", derive=_inference_k(1), baseline="rnn_luong_soft"),
    Row("beam_joint_rnn_bahdanau_k6", "beam-joint on the hybrid's Bahdanau-style GRU (the earlier GRU setting; not the "
        "paper's decoder)", "above hybrid_additive (soft)", build=_beam_joint("rnn", joint_k=6, **EARLIER_RNN),
        baseline="hybrid_additive"),
    Row("beam_joint_rnn_bahdanau_k6_decoded_k1", "beam-joint, Table 2 (the earlier GRU setting)",
        "below K=6, still above hybrid_additive (soft)", source="beam_joint_rnn_bahdanau_k6", derive=_inference_k(1),
        baseline="hybrid_additive"),
    Row("beam_joint_k6", "beam-joint in the last Transformer layer (the paper's future work)", "above soft",
        build=_beam_joint("transformer", joint_k=6)),
    Row("beam_joint_k6_decoded_k1", "beam-joint, Table 2", "below K=6, still above soft",
        source="beam_joint_k6", derive=_inference_k(1)),
    Row("full_joint_rnn", "full-joint, Fig. 1a and the de-N table (the paper's LSTM decoder)",
        "above rnn_luong_soft (soft), level with beam_joint_rnn_k6",
        build=_beam_joint("rnn", full_joint=True, **PAPER_RNN), tasks=("nouns",), baseline="rnn_luong_soft"),
    Row("full_joint_rnn_bahdanau", "full-joint on the Bahdanau-style GRU (the earlier GRU setting)",
        "above hybrid_additive (soft), level with beam_joint_rnn_bahdanau_k6",
        build=_beam_joint("rnn", full_joint=True, **EARLIER_RNN), tasks=("nouns",), baseline="hybrid_additive"),
    *[Row(f"recurrent_{v}", "recurrent cross-attention, Table 2", "about equal to soft", build=_recurrent(v))
      for v in ("concat_context", "concat_weight", "concat_accumulated", "expand_1", "continuity", "coverage")],
]
ROW_NAMES = [row.name for row in ROWS]


def rows_for(task: str) -> list[Row]:
    return [row for row in ROWS if task in row.tasks]


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
TEST_SET = "test_2016_flickr"  # the table's main Multi30k set (the row's ``score``)
VALIDATION_SET = "val"  # scored beside it (a verdict must hold on more than one set)


def validation_set(task: str, recipe: Recipe, data: str | None):
    """The second scored set of a Multi30k row (the validation split, cut to ``recipe.eval_size`` like the test set),
    or None: the nouns task, or a ``--data`` source without one."""
    if task != "multi30k":
        return None
    if data is None:
        val = multi30k(VALIDATION_SET)
    elif os.path.isdir(data):
        try:
            val = load_parallel(data, VALIDATION_SET)
        except FileNotFoundError:
            return None
    else:
        loaded = datasets.load_dataset(data)
        if "validation" not in loaded:
            return None
        val = loaded["validation"].map(lambda row: {"source": row["translation"]["en"],
                                                   "target": row["translation"]["de"]},
                                       remove_columns=loaded["validation"].column_names)
    if recipe.eval_size is not None:
        val = val.select(range(min(recipe.eval_size, len(val))))
    return val


def patience_set(task: str, recipe: Recipe, data: str | None, seed: int):
    """The split the patience rule evaluates on (cut to ``recipe.eval_size``): Multi30k's validation split (the one
    :func:`validation_set` scores), the nouns' validation lemmas; None where the data has none."""
    if task == "multi30k":
        return validation_set(task, recipe, data)
    val = german_nouns(seed=seed, max_examples=recipe.max_examples)["validation"]
    return val if recipe.eval_size is None else val.select(range(min(recipe.eval_size, len(val))))


def load_task(task: str, recipe: Recipe, data: str | None, seed: int):
    """(train, test) Datasets with "source"/"target" columns."""
    if task == "multi30k":
        if data is None:
            train, test = multi30k("train"), multi30k("test_2016_flickr")
        elif os.path.isdir(data):
            train, test = load_parallel(data, "train"), load_parallel(data, "test_2016_flickr")
        else:  # a datasets hub name / local dataset with "translation" {"en", "de"} rows
            loaded = datasets.load_dataset(data)

            def flat(split):
                return split.map(lambda row: {"source": row["translation"]["en"], "target": row["translation"]["de"]},
                                 remove_columns=split.column_names)
            train, test = flat(loaded["train"]), flat(loaded["test"])
    else:
        splits = german_nouns(seed=seed, max_examples=recipe.max_examples)
        train, test = splits["train"], splits["test"].shuffle(seed=seed)
    if recipe.eval_size is not None:
        test = test.select(range(min(recipe.eval_size, len(test))))
    return train, test


# ----------------------------------------------------------------------------------------------------------------
# One row
# ----------------------------------------------------------------------------------------------------------------
def row_scores(hypotheses, references) -> dict:
    """sacrebleu's corpus BLEU and chrF (default settings, :func:`~hf_hardattn_cli.scores.corpus_scores`) with their
    signatures, as a row records them."""
    scores = corpus_scores(hypotheses, [list(references)])
    (bleu, bleu_signature), (chrf, chrf_signature) = scores["bleu"], scores["chrf"]
    return dict(bleu=round(bleu.score, 2), chrf=round(chrf.score, 2), signature=bleu_signature,
                chrf_signature=chrf_signature)


def evaluate(task, model, tokenizer, test, recipe: Recipe, return_hypotheses: bool = False, other_sets=None) -> dict:
    """The row's score (BLEU or exact match of beam ``recipe.num_beams``), test-set sentences/s (one timing) and three
    samples; with ``return_hypotheses`` every output too (key ``hypotheses``). Multi30k: ``scores`` {set: BLEU} and
    ``chrf`` {set: chrF} of ``test_2016_flickr`` and of every ``other_sets`` {name: Dataset} (decoded the same way)."""
    start = time.perf_counter()
    hypotheses = training.translate(model, tokenizer, test["source"], num_beams=recipe.num_beams,
                           batch_size=recipe.eval_batch_size, max_length=recipe.max_length)
    seconds = time.perf_counter() - start
    out = dict(decode_seconds=round(seconds, 1), sentences_per_s=round(len(hypotheses) / seconds, 2),
               examples=len(hypotheses), samples=[[s, h, r] for s, h, r in zip(test["source"][:3], hypotheses[:3],
                                                                                 test["target"][:3])])
    if task == "multi30k":
        scored = row_scores(hypotheses, test["target"])
        out.update(metric="BLEU", score=scored["bleu"], signature=scored["signature"],
                   chrf_signature=scored["chrf_signature"], scores={TEST_SET: scored["bleu"]},
                   chrf={TEST_SET: scored["chrf"]})
        for name, dataset in (other_sets or {}).items():
            other = training.translate(model, tokenizer, dataset["source"], num_beams=recipe.num_beams,
                                       batch_size=recipe.eval_batch_size, max_length=recipe.max_length)
            scored = row_scores(other, dataset["target"])
            out["scores"][name], out["chrf"][name] = scored["bleu"], scored["chrf"]
    else:
        correct = sum(h.strip() == r.strip() for h, r in zip(hypotheses, test["target"]))
        out.update(metric="accuracy", score=round(100 * correct / len(hypotheses), 2))
    if return_hypotheses:
        out["hypotheses"] = hypotheses
    return out


def batch_size_for(recipe: Recipe, train_tok) -> tuple[float, int]:
    """(mean max(source, target) tokens per training example, sentences per batch): the recipe's ``max_tokens``
    per batch as a number of sentences, as every row trains."""
    lengths = training.example_lengths(train_tok)  # max(source, target) tokens: what a max-tokens batch counts
    per_sentence = sum(lengths) / len(lengths)
    return per_sentence, max(1, round(recipe.max_tokens / per_sentence))


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def convergence_rule(ctx, min_steps: int = 0, kd_stage: bool = False):
    """The recipe's patience rule as a :class:`~hf_hardattn.tools.training.Convergence` callback (None without one):
    the validation split's loss (teacher-forced NLL per token) or its BLEU (beam ``recipe.num_beams``): the recipe's
    ``patience_metric``, or for a stage trained on the teacher's translations (``kd_stage``) its kd_patience_metric."""
    recipe = ctx["recipe"]
    if recipe.patience is None:
        return None
    metric = recipe.kd_patience_metric if kd_stage and recipe.kd_patience_metric else recipe.patience_metric
    if metric == "val_loss":
        def evaluate(model):
            return training.validation_loss(model, ctx["tokenizer"], ctx["patience_tok"], recipe.eval_batch_size)
    else:
        def evaluate(model):
            hypotheses = training.translate(model, ctx["tokenizer"], ctx["patience"]["source"],
                                            num_beams=recipe.num_beams, batch_size=recipe.eval_batch_size,
                                            max_length=recipe.max_length)
            return row_scores(hypotheses, ctx["patience"]["target"])["bleu"]
    return training.Convergence(evaluate, every=recipe.eval_steps, patience=recipe.patience, metric=metric,
                                min_steps=min_steps)


def train_row(row: Row, ctx, model, train_tok) -> dict:
    recipe, args = ctx["recipe"], ctx["args"]
    rules = {}  # stage -> its Convergence callback
    average = recipe.average_checkpoints
    checkpoint_steps = recipe.checkpoint_steps or recipe.eval_steps or recipe.max_steps  # and the run's last step
    trainer_dir = os.path.join(ctx["out"], "trainer", row.name)
    # a row trained by steps (a paper's recipe: to convergence) resumes an interrupted run of itself from its last
    # complete checkpoint; anything else in the folder (another recipe, seed or model; --force) is removed first
    resumable = recipe.minutes is None  # a wall-clock budget's schedule cannot be resumed to the same end
    resume = prepare_trainer_dir(ctx, row, model, trainer_dir, resumable)

    def budget(minutes, max_steps, warmup_steps=recipe.warmup_steps, stage="train", min_steps=0, carry=None):
        kwargs = dict(max_steps=max_steps, minutes=minutes, batch_size=ctx["batch_size"],
                      learning_rate=recipe.learning_rate, warmup_steps=warmup_steps,
                      lr_scheduler=recipe.lr_scheduler, bf16=recipe.bf16, seed=args.seed, logging_steps=50,
                      progress=not args.quiet)
        rule = convergence_rule(ctx, min_steps, kd_stage=stage == "kd")
        if rule is not None:
            rules[stage] = rule
            kwargs["callbacks"] = [rule]
        if carry is not None:
            kwargs["carry"] = carry
        last = stage in ("train", "kd")  # the last stage saves the checkpoints that are averaged
        if resumable:  # every stage saves checkpoints it can resume from (with the optimizer), the last one `average`
            kwargs.update(save_steps=checkpoint_steps, save_total_limit=max(average, 1) if last else 1)
        elif average and last:
            kwargs.update(save_steps=checkpoint_steps, save_total_limit=average, save_only_model=True)
        return kwargs

    def teacher_budget(stage, carry=None):  # the teacher's cap and rule, and at least the steps the teacher took
        teacher_steps = ctx["results"]["soft"]["steps"]
        kwargs = budget(recipe.minutes, recipe.max_steps, stage=stage, carry=carry,
                        min_steps=teacher_steps if recipe.patience else 0)
        if recipe.patience is None and recipe.max_steps is not None:
            kwargs["max_steps"] = max(recipe.max_steps, teacher_steps)
        return kwargs

    start = time.perf_counter()
    adopted = row.two_stage and recipe.mle_stage == "row"  # stage 1 is row.mle_row's training, finished
    stage_one = is_mle_row(recipe.mle_stage, row.name)  # this row is an Eq. 1 row's stage 1: Eq. 1 continues it
    if row.kd_scheme is not None:
        stage_warmup = None
        if row.two_stage and recipe.mle_stage in ("teacher", "row"):
            # the MLE stage with the teacher's budget, then Eq. 1 continuing the same optimizer and schedule (no
            # restart, no second warm-up); "row": that MLE stage is row.mle_row's training, which Eq. 1 continues
            carry = training.OptimizerCarry()
            mle = teacher_budget("mle", carry)
            kd = budget(recipe.minutes, recipe.max_steps, stage="kd", carry=carry)
            if adopted:
                adopt_mle_stage(ctx, row, model, trainer_dir)
                resume = True
        elif row.two_stage:  # the row's budget, split in half: stage 1 MLE, stage 2 the KD scheme
            first_steps = None if recipe.max_steps is None else max(1, recipe.max_steps // 2)
            second_steps = None if recipe.max_steps is None else max(1, recipe.max_steps - first_steps)
            half = None if recipe.minutes is None else recipe.minutes / 2
            # each stage runs the preset's schedule compressed onto its half, warm-up included (with the whole
            # warm-up, 1000 steps of the cpu preset's 1500-step rows, a 750-step stage would end still warming up,
            # its learning rate never decayed)
            stage_warmup = max(1, recipe.warmup_steps // 2)
            mle = budget(half, first_steps, stage_warmup, stage="mle")
            kd = budget(half, second_steps, stage_warmup, stage="kd")
        else:
            mle, kd = False, budget(recipe.minutes, recipe.max_steps, stage="kd")  # no MLE stage: hybrid_*_kd
            stage_warmup = recipe.warmup_steps
        first, second = distill.train_two_stage(model, ctx["tokenizer"], kd_data(ctx), kd_scheme=row.kd_scheme, mle=mle,
                                                kd=kd, max_length=recipe.max_length, output_dir=trainer_dir,
                                                resume_from_checkpoint=resume)
        stages = {"mle": first.state.global_step if first is not None else 0, "kd": second.state.global_step}
        losses = (_losses(first) if first is not None else []) + _losses(second)
        result = dict(steps=sum(stages.values()), kd_scheme=row.kd_scheme, stages=stages,
                      stage_warmup_steps=stage_warmup, mle_stage=recipe.mle_stage if row.two_stage else None,
                      mle_row=row.mle_row if adopted else None,
                      continued_optimizer=row.two_stage and recipe.mle_stage in ("teacher", "row"),
                      first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                      teacher="soft", distill_beams=recipe.distill_beams)
        last_dir = os.path.join(trainer_dir, "kd")
    else:
        extra = {}
        if row.name == "marian":  # MarianMTModel's own loss has no label smoothing: the Trainer's LabelSmoother does it
            extra["label_smoothing_factor"] = recipe.label_smoothing
        resume_train = resume and checkpointing.last_complete_checkpoint(trainer_dir) is not None
        # an Eq. 1 row's MLE stage (mle_stage "row"): the teacher's budget, its final checkpoint kept with the optimizer
        kwargs = teacher_budget("train") if stage_one else budget(recipe.minutes, recipe.max_steps)
        trainer = training.train_seq2seq(model, ctx["tokenizer"], train_tok, output_dir=trainer_dir,
                                         resume_from_checkpoint=resume_train, **kwargs, **extra)
        losses = _losses(trainer)
        result = dict(steps=trainer.state.global_step, first_loss=losses[0] if losses else None,
                      last_loss=losses[-1] if losses else None)
        last_dir = trainer_dir
    # minutes of training: this process's, plus those of the runs it resumed (up to their last evaluation)
    earlier = sum(rule.minutes_before for rule in rules.values())
    result["train_minutes"] = round((time.perf_counter() - start) / 60 + earlier, 2)
    if rules:  # convergence: each stage's record; the row converged when every stage did
        records = {stage: rule.record() for stage, rule in rules.items()}
        if adopted:  # stage 1 is row.mle_row's run: its record as that row stored it (where it resumed, if it did)
            records["mle"] = ctx["results"][row.mle_row]["convergence"]
        resumed = {stage: record["resumed_at"] for stage, record in records.items()
                   if record["resumed_at"] and not (adopted and stage == "mle")}
        if resumed:  # where each stage took up an interrupted run (its step), e.g. on another day or machine
            result["resumed_at"] = resumed
        result["convergence"] = records["train"] if set(records) == {"train"} else records
        result["converged"] = all(record["converged"] for record in records.values())
    if average:  # the paper's evaluation: the mean of the last saved checkpoints
        paths = checkpointing.last_checkpoints(last_dir, average)
        checkpointing.load_average(model, paths)
        result["averaged_checkpoints"] = [int(os.path.basename(p).rsplit("-", 1)[1]) for p in paths]
        result["checkpoint_steps"] = checkpoint_steps
    checkpointing.end_redo(trainer_dir)  # trained: a --force from now on trains the row anew
    if not stage_one:  # the row is finished
        checkpointing.drop_optimizer_states(last_dir, os.path.join(trainer_dir, "mle"))
    return result


def is_mle_row(mle_stage: str | None, name) -> bool:
    """Whether row ``name`` is an Eq. 1 row's MLE stage: a ``hybrid_*`` row under a recipe's mle_stage "row"."""
    return mle_stage == "row" and any(row.mle_row == name for row in ROWS)


def adopt_mle_stage(ctx, row: Row, model, trainer_dir) -> None:
    """Stage 1 of ``row`` under the recipe's mle_stage "row": the finished training of ``row.mle_row`` (same seed,
    recipe, batch and model configuration), its final checkpoint (weights, optimizer, schedule, log) copied to
    ``trainer_dir/mle``, from which ``distill.train_two_stage(resume_from_checkpoint=True)`` continues with Eq. 1."""
    mle_dir = os.path.join(trainer_dir, "mle")
    if checkpointing.finished_run(mle_dir) is not None:  # adopted already (an interrupted Eq. 1 stage resumes)
        return
    source = os.path.join(ctx["out"], "trainer", row.mle_row)
    ended = checkpointing.finished_run(source)
    try:
        with open(os.path.join(source, "run.json"), encoding="utf-8") as handle:
            recorded = json.load(handle)
    except FileNotFoundError:
        recorded = None
    if (ended is None or recorded != row_identity(ctx, row.mle_row, model)
            or not os.path.isfile(os.path.join(ended.checkpoint, checkpointing.OPTIMIZER_FILE))):
        raise ValueError(f"`{row.name}` continues the training of `{row.mle_row}` (the {ctx['recipe'].name} recipe's "
                         f"mle_stage 'row'), and {source!r} holds no finished run of it with this seed, recipe and "
                         f"model, with its optimizer; allowed: run `{row.mle_row}` into this output folder first "
                         f"(--rows {row.mle_row} --force).")
    with atomic_folder(mle_dir, drop=lambda name: True) as staging:
        shutil.copytree(ended.checkpoint, os.path.join(staging, os.path.basename(ended.checkpoint)))


def prepare_trainer_dir(ctx, row: Row, model, trainer_dir, resumable: bool) -> bool:
    """True when ``trainer_dir`` holds an interrupted run of this very row (same row, seed, recipe, batch and model
    configuration) that may resume: ``resumable`` (the recipe trains by steps, not minutes), and under --force only a
    --force rerun cut off before its training ended; otherwise it is emptied
    (:func:`~hf_hardattn.tools.checkpointing.prepare_run_folder`)."""
    identity = row_identity(ctx, row.name, model, kd=row.kd)
    return checkpointing.prepare_run_folder(trainer_dir, identity, resumable, redo=getattr(ctx["args"], "force", False))


def row_identity(ctx, name: str, model, kd: bool = False) -> dict:
    """What the training of row ``name`` depends on (``trainer/ROW/run.json``), as JSON reads it back; the recipe's
    KD-stage fields only for a row with a KD stage (``kd``) and where set (an Eq. 1 row's MLE stage ignores them)."""
    config = getattr(model, "config", None)  # (None: a test's stand-in for the model)
    config = {k: v for k, v in config.to_dict().items() if k != "transformers_version"} if config is not None else None
    recipe = dataclasses.asdict(ctx["recipe"])
    for field in KD_STAGE_FIELDS:
        if not kd or recipe[field] is None:
            del recipe[field]
    identity = dict(row=name, seed=ctx["args"].seed, recipe=recipe, batch_size=ctx["batch_size"], config=config)
    return json.loads(json.dumps(identity, default=str, sort_keys=True))


def kd_data(ctx):
    """The soft teacher's translations (beam ``recipe.distill_beams``, 4 today) of the training sources ("target")
    beside the references ("reference"), as strings (resumable, cached in the output folder). With the teacher's model
    in the output folder they are translated and kept in ``--results-dir`` too (:func:`kd_data_path`); without it
    (a fresh machine), they are read from there, so that the KD rows need neither the model nor its training again."""
    if "kd_data" not in ctx:
        recipe, path = ctx["recipe"], kd_data_path(ctx)
        identity = dict(num_beams=recipe.distill_beams, max_length=recipe.max_length,
                        teacher={key: ctx["results"]["soft"].get(key) for key in KD_TEACHER_KEYS})
        if os.path.isdir(model_dir(ctx, "soft")):
            teacher = on_accelerator(load_model(ctx, "soft"))
            ctx["kd_data"] = distill.translate_dataset(teacher, ctx["tokenizer"], ctx["train"],
                                                       os.path.join(ctx["out"], "kd_data"),
                                                       num_beams=recipe.distill_beams,
                                                       batch_size=recipe.eval_batch_size,
                                                       max_length=recipe.max_length, progress=not ctx["args"].quiet)
            if path is not None:
                distill.save_translations(path, ctx["kd_data"], **identity)
        else:  # the teacher's row from --results-dir (teacher_from_results): its translations are there
            ctx["kd_data"] = distill.load_translations(path, ctx["train"], **identity)
    return ctx["kd_data"]


KD_STAGE_FIELDS = ("kd_patience_metric",)  # recipe fields that only a KD stage reads
KD_SUFFIX = "_kd_data.jsonl.gz"  # beside the results JSON: the teacher's translations (a header line, then one per row)
KD_TEACHER_KEYS = ("seed", "steps", "score", "scores")  # the teacher row's fields that tie its translations to it


def kd_data_path(ctx):
    """Where ``--results-dir`` keeps the teacher's translations (None without one)."""
    folder = ctx["args"].results_dir
    if folder is None:
        return None
    return os.path.join(folder, results_stem(ctx["task"], ctx["preset"], ctx["recipe"].name) + KD_SUFFIX)


def teacher_from_results(ctx, name, wanted, rows) -> bool:
    """Whether row ``name`` is the soft teacher needed only for what the results hold: its steps (the hybrid_* rows'
    budget) and, for the KD rows among ``rows`` (this run's), its translations in ``--results-dir``; not asked for
    and decoded by no row."""
    path = kd_data_path(ctx)
    return (name == "soft" and name not in wanted and not any(row.source == name for row in rows)
            and (not any(row.kd for row in rows) or (path is not None and os.path.isfile(path))))


def model_dir(ctx, name):
    return os.path.join(ctx["out"], "models", name)


def load_model(ctx, name):
    return AutoModelForSeq2SeqLM.from_pretrained(model_dir(ctx, name)).eval()


def on_accelerator(model):
    """``model`` on the GPU where there is one (as a trained row's model is after training), so that a loaded teacher
    or a derived row decodes there too: on one host CPU thread the teacher's 29k training translations outlasted a
    whole GPU call (2026-11-27)."""
    return model.cuda() if torch.cuda.is_available() else model


# model config fields a row's JSON records (result["model_fields"]): what the recipe and the row set
MODEL_FIELDS = ("d_model", "dropout", "attention_dropout", "label_smoothing", "init_std", "embed_init_std",
                "retrieval_dropout", "rnn_hidden_size", "rnn_embedding_size", "encoder_attention", "decoder_attention",
                "cross_attention")


def run_row(row: Row, ctx) -> dict:
    args, recipe = ctx["args"], ctx["recipe"]
    result = dict(row=row.name, paper=row.paper, expect=row.expect, seed=args.seed, command=row_command(ctx, row.name),
                  recipe_name=recipe.name,  # the recipe per row too: rows of one table may come from different runs
                  recipe=dataclasses.asdict(recipe),
                  machine=training.machine())  # and machines: minutes of training only compare on the same one
    if row.source is not None:
        model = on_accelerator(row.derive(load_model(ctx, row.source)).eval())
        result.update(decoded_from=row.source, train_minutes=ctx["results"][row.source]["train_minutes"],
                      steps=ctx["results"][row.source]["steps"])
    else:
        torch.manual_seed(args.seed)
        model = row.build(ctx)
        result.update(train_row(row, ctx, model, ctx["train_tok"]))
    result["params"] = sum(p.numel() for p in model.parameters())
    result["model_type"] = model.config.model_type
    result["init_std"] = getattr(model.config, "init_std", None)  # None: Xavier linears, N(0, d^-1/2) embeddings
    result["embed_init_std"] = getattr(model.config, "embed_init_std", None)  # None: the embeddings follow init_std
    # every training setting of the model itself (a row's own override, e.g. the beam-joint rows' label smoothing 0,
    # shows here beside the recipe's); marian's label smoothing is the Trainer's, the recipe's
    result["model_fields"] = {name: getattr(model.config, name) for name in MODEL_FIELDS if hasattr(model.config, name)}
    if row.name == "marian":
        result["model_fields"]["label_smoothing"] = recipe.label_smoothing
    others = {VALIDATION_SET: ctx["val"]} if ctx.get("val") is not None else None
    result.update(evaluate(ctx["task"], model, ctx["tokenizer"], ctx["test"], recipe, other_sets=others))
    result["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
    folder = model_dir(ctx, row.name)
    save_row_model(ctx, row.name, model, result, folder)
    if getattr(args, "export_fp16", None) and row.source is None:  # a trained row's final (averaged) weights in fp16
        save_row_model(ctx, row.name, copy.deepcopy(model).half(), result, os.path.join(args.export_fp16, row.name))
    return result


def save_row_model(ctx, name, model, result, folder):
    """``model`` with its tokenizer (and, for an hf_hardattn model, its card showing the row) in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    if hasattr(model, "card_title"):  # hf_hardattn models: the card shows the table (refreshed in write_outputs)
        write_card_results(folder, name, row_table(ctx["task"], ctx["preset"], {name: result}))
        model.save_pretrained(folder, tokenizer=ctx["tokenizer"])  # one atomic save of weights, card and tokenizer
    else:  # marian: transformers' own save
        model.save_pretrained(folder)
        ctx["tokenizer"].save_pretrained(folder)


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------
def row_table(task, preset, results: dict) -> str:
    """The markdown table of ``results``; its "ours vs" column puts each row's score difference to the row the paper's
    direction compares with (``Row.baseline``, soft unless said) beside that direction, so that a claim that failed
    reads as such in the table itself."""
    metric = f"BLEU {TEST_SET}" if task == "multi30k" else "exact match %"
    # Multi30k rows scored on the validation split too (older rows have only test BLEU: "-")
    two_sets = task == "multi30k" and any("scores" in r for r in results.values())
    extra_head, extra_align = (f" BLEU {VALIDATION_SET} | chrF {TEST_SET} / {VALIDATION_SET} |", " ---: | ---: |") \
        if two_sets else ("", "")
    lines = [f"| row | {metric} |{extra_head} sentences/s (beam 4) | training min | steps | parameters | paper "
             f"| paper's direction | ours vs |",
             f"| --- | ---: |{extra_align} ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for row in ROWS:  # the paper columns come from the row's current definition, not from when it was run
        if row.name in results:
            r = results[row.name]
            trained = f"(= {r['decoded_from']})" if r.get("decoded_from") else f"{r['train_minutes']:.1f}"
            base = results.get(row.baseline)
            versus = f"{r['score'] - base['score']:+.2f} vs {row.baseline}" if base and row.baseline != row.name else ""
            if two_sets and base and row.baseline != row.name and VALIDATION_SET in r.get("scores", {}) \
                    and VALIDATION_SET in base.get("scores", {}):
                versus += f" ({r['scores'][VALIDATION_SET] - base['scores'][VALIDATION_SET]:+.2f} on {VALIDATION_SET})"
            extra = ""
            if two_sets:
                val = r.get("scores", {}).get(VALIDATION_SET)
                chrf = r.get("chrf", {})
                extra = (f" {'-' if val is None else f'{val:.2f}'} | "
                         f"{' / '.join('-' if chrf.get(k) is None else f'{chrf[k]:.2f}' for k in (TEST_SET, VALIDATION_SET))} |")
            lines.append(f"| {row.name} | {r['score']:.2f} |{extra} {r['sentences_per_s']:.1f} | {trained} | {r['steps']} "
                         f"| {r['params']:,} | {row.paper} | {row.expect} | {versus} |")
    return "\n".join(lines)


def write_card_results(folder, name, table):
    text = (f"This model is row `{name}` of the reproduction table (`benchmarks/reproduce.py`, one recipe for every "
            f"variant):\n\n{table}")
    write_json_atomic(os.path.join(folder, RESULTS_FILE), {"table": text})


def refresh_cards(ctx, table):
    """Rewrite the model card of every finished hf_hardattn row with the current table."""
    for name in ctx["results"]:
        folder = model_dir(ctx, name)
        if not os.path.exists(os.path.join(folder, RESULTS_FILE)):  # marian: not an hf_hardattn model
            continue
        write_card_results(folder, name, table)
        with torch.device("meta"):  # the card needs the architecture and parameter count only
            model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(folder))
        write_model_card(model, folder)


def write_outputs(ctx):
    """Write results.json / .md (merged with rows that another process running other rows has written meanwhile to
    the same output folder or the same ``--results-dir``) and refresh the model cards."""
    task, preset, results = ctx["task"], ctx["preset"], ctx["results"]
    file_stem = results_stem(task, preset, ctx["recipe"].name)
    folders = [folder for folder in (ctx["out"], ctx["args"].results_dir) if folder is not None]
    add_stored_rows(results, folders, file_stem)
    payload = dict(task=task, preset=preset, recipe_name=ctx["recipe"].name, recipe=dataclasses.asdict(ctx["recipe"]),
                   batch_size=ctx["batch_size"],
                   tokens_per_sentence=ctx["tokens_per_sentence"], vocab_size=len(ctx["tokenizer"]),
                   test_examples=len(ctx["test"]), rows=results)
    table = row_table(task, preset, results)
    for folder in dict.fromkeys(folders):
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, file_stem)
        write_json_atomic(stem + ".json", payload)  # atomic: a reader (or a killed run's successor) never sees half
        recipe_words = "" if ctx["recipe"].name == "today" else f", the {ctx['recipe'].name} paper's recipe"
        write_text_atomic(stem + ".md", f"# {task}, preset {preset}{recipe_words}\n\n{table}\n")
    refresh_cards(ctx, table)
    return table


def add_stored_rows(results: dict, folders, file_stem: str) -> dict:
    """``results`` with every row stored in ``FOLDER/FILE_STEM.json`` (folders in order) that it lacks or holds in an
    older version (an earlier ``finished``; rows without one are the oldest): a row rerun by another process into a
    shared ``--results-dir`` is not put back by an output folder's stale copy. Ties keep the row held first."""
    for folder in folders:
        path = os.path.join(folder, f"{file_stem}.json")
        if os.path.exists(path):
            with open(path) as handle:
                for name, row in json.load(handle)["rows"].items():
                    if name not in results or row.get("finished", "") > results[name].get("finished", ""):
                        results[name] = row
    return results


def results_stem(task: str, preset: str, recipe: str = "today") -> str:
    """The results files' name: ``reproduce_TASK_PRESET`` (today's recipe) or ``reproduce_TASK_PRESET_RECIPE``."""
    return f"reproduce_{task}_{preset}" + ("" if recipe == "today" else f"_{recipe}")


def row_command(ctx, name) -> str:
    args = ctx["args"]
    parts = ["python", "benchmarks/reproduce.py", "--task", ctx["task"], "--preset", ctx["preset"], "--rows", name,
             "--seed", str(args.seed)]
    if getattr(args, "recipe", "today") != "today":
        parts += ["--recipe", args.recipe]
    for flag in (*RECIPE_OVERRIDES, "patience_metric", "kd_patience_metric", "init_std", "embed_init_std", "precision",
                 "data", "output_dir", "threads"):
        value = getattr(args, flag)
        if value is not None:
            parts += [f"--{flag.replace('_', '-')}", str(value)]
    return shlex.join(parts)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
# flags that replace a recipe's value (positive numbers)
RECIPE_OVERRIDES = ("minutes", "max_steps", "learning_rate", "eval_size", "patience", "eval_steps")


def _std_or(word: str):
    """An argparse type: ``word`` (kept as the string) or a positive finite std. --init-std takes "xavier" (config
    init_std None), --embed-init-std "follow" (config embed_init_std None: as init_std says)."""
    def parse(text: str):
        if text == word:
            return word
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be '{word}' or a positive number, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--task", choices=TASKS, default="multi30k", help="which table: Multi30k en-de or German nouns")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                        help="recipe and sizes (cpu: the tables; base: Transformer-base, GPU; tiny: tests)")
    parser.add_argument("--recipe", choices=RECIPE_NAMES, default="today",
                        help="today (default: the preset's) or a paper's recipe on the preset's sizes for that paper's "
                             "rows, trained to convergence (--patience) with a cap (--max-steps); see the description")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help=f"rows to run (default: all of the task's); choices: {' '.join(ROW_NAMES)}")
    parser.add_argument("--data", default=None, help="multi30k: a folder of {train,test_2016_flickr}.{en,de}[.gz] "
                                                     "or a datasets name with en/de 'translation' rows")
    parser.add_argument("--minutes", type=float, default=None, help="override the preset's minutes per row")
    parser.add_argument("--max-steps", type=int, default=None, help="override the preset's steps per row")
    parser.add_argument("--learning-rate", type=float, default=None, help="override the preset's peak learning rate")
    parser.add_argument("--eval-size", type=int, default=None, help="override the preset's number of test examples")
    parser.add_argument("--patience", type=int, default=None,
                        help="stop once the validation metric has not improved for this many evaluations "
                             "(--eval-steps apart), or at the cap (--max-steps / --minutes) (default: the recipe's)")
    parser.add_argument("--patience-metric", choices=tuple(training.PATIENCE_METRICS), default=None,
                        help="the metric of --patience: val_loss (default: the validation split's teacher-forced NLL "
                             "per token) or val_bleu (its BLEU, beam 4: slower)")
    parser.add_argument("--kd-patience-metric", choices=tuple(training.PATIENCE_METRICS), default=None,
                        help="the metric of --patience for a stage trained on the teacher's translations (a KD row's "
                             "stage 2; default: the recipe's, under --recipe hybrid val_bleu, else --patience-metric)")
    parser.add_argument("--eval-steps", type=int, default=None,
                        help="steps between the evaluations of --patience (default: the recipe's)")
    parser.add_argument("--init-std", type=_std_or("xavier"), default=None, metavar="{xavier,STD}",
                        help="initialisation of every hf_hardattn row (config init_std; embed_init_std None unless "
                             "--embed-init-std is given): 'xavier' (Xavier-uniform linears, N(0, d_model^-1/2) "
                             "embeddings: the earlier default) or a positive std (every linear and embedding "
                             "N(0, STD)); default: the model type's and recipe's default")
    parser.add_argument("--embed-init-std", type=_std_or("follow"), default=None, metavar="{follow,STD}",
                        help="initialisation of every hf_hardattn row's embeddings alone (config embed_init_std): "
                             "'follow' (as --init-std says) or a positive std (N(0, STD)); default: the recipe's "
                             "(nouns: follow) or else the model type's (0.02 for soft, hard retrieval, recurrent, beam-joint "
                             "Transformer; follow for Gaussian, hybrid, beam-joint RNN)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="override the preset's training precision (bf16 autocast needs a CPU with AVX512 or "
                             "AMX, or a GPU)")
    parser.add_argument("--output-dir", default=None, help="models, KD data and results (default "
                                                           "outputs/reproduce/TASK-PRESET)")
    parser.add_argument("--results-dir", default=None, help="also write reproduce_TASK_PRESET.{json,md} here")
    parser.add_argument("--export-fp16", default=None, metavar="DIR",
                        help="also save each trained row's final model (under --recipe hard_retrieval: the average of "
                             "its last checkpoints) in fp16 safetensors with its tokenizer and card to DIR/ROW, small "
                             "enough to keep beside the results (a d_model 256 row: about 15 MB)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of every row (default 0)")
    parser.add_argument("--force", action="store_true", help="rerun finished rows (a rerun cut off resumes with --force)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> dict:
    task_rows = {row.name: row for row in rows_for(args.task)}
    recipe_name = getattr(args, "recipe", "today")
    if recipe_name != "today":  # a paper's recipe: that paper's rows (its comparison), every one alike
        task_rows = {name: row for name, row in task_rows.items() if name in PAPER_RECIPES[recipe_name]["rows"]}
    wanted = args.rows or list(task_rows)
    unknown = [name for name in wanted if name not in task_rows]
    if unknown:
        where = f"task {args.task!r}" + ("" if recipe_name == "today" else f" under --recipe {recipe_name}")
        raise ValueError(f"`rows` {unknown} are not rows of {where}; allowed: {list(task_rows)}.")
    for name in RECIPE_OVERRIDES:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"`--{name.replace('_', '-')}` must be > 0, got {value!r}.")
    if args.threads:
        torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    recipe = recipe_for(args.task, args.preset, recipe_name)
    for name in RECIPE_OVERRIDES:  # the recipe every row uses and stores
        if getattr(args, name) is not None:
            setattr(recipe, name, getattr(args, name))
    for name in ("patience_metric", "kd_patience_metric"):
        if getattr(args, name, None) is not None:
            setattr(recipe, name, getattr(args, name))
    if args.precision is not None:
        recipe.bf16 = args.precision == "bf16"
    if recipe.patience is not None and recipe.eval_steps is None:
        raise ValueError(f"`--patience` {recipe.patience} needs `--eval-steps` (the steps between its evaluations); "
                         f"the {recipe.name} recipe of preset {args.preset!r} has none.")
    training.check_bf16(recipe.bf16, name=f"--preset {args.preset}", fix="Pass --precision fp32 (its rows are then not "
               "comparable with a table trained in bf16 for the same minutes)")
    suffix = "" if recipe.name == "today" else f"-{recipe.name}"
    out = args.output_dir or os.path.join("outputs", "reproduce", f"{args.task}-{args.preset}{suffix}")
    os.makedirs(out, exist_ok=True)
    # rows already in the table: the output folder's (with their models), then those only in --results-dir (e.g. a
    # fresh machine without outputs/) or finished there later (a rerun by another process), which a new row joins
    # instead of replacing them; a row without its model is rerun when it is asked for or needed
    results = add_stored_rows({}, [folder for folder in (out, args.results_dir) if folder is not None],
                              results_stem(args.task, args.preset, recipe.name))

    train, test = load_task(args.task, recipe, args.data, args.seed)
    tokenizer_dir = os.path.join(out, "tokenizer")
    if os.path.isdir(tokenizer_dir):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = train_tokenizer(train, **recipe.tokenizer)
        with atomic_folder(tokenizer_dir) as staging:  # a killed save leaves no half tokenizer for the next run to load
            tokenizer.save_pretrained(staging)
    train_tok = training.tokenize_dataset(train, tokenizer, max_length=recipe.max_length)
    per_sentence, batch_size = batch_size_for(recipe, train_tok)
    ctx = dict(args=args, task=args.task, preset=args.preset, recipe=recipe, out=out, train=train, test=test,
               val=validation_set(args.task, recipe, args.data), tokenizer=tokenizer, train_tok=train_tok,
               results=results, tokens_per_sentence=round(per_sentence, 2), batch_size=batch_size)
    if recipe.patience is not None:  # the split the patience rule evaluates on
        ctx["patience"] = patience_set(args.task, recipe, args.data, args.seed)
        if ctx["patience"] is None:
            raise ValueError(f"`--patience` needs a validation split, and --data {args.data!r} has none (a folder with "
                             f"{VALIDATION_SET}.{{en,de}} or a dataset with a 'validation' split).")
        ctx["patience_tok"] = training.tokenize_dataset(ctx["patience"], tokenizer, max_length=recipe.max_length)
    if args.init_std is not None:
        ctx["init_std"] = None if args.init_std == "xavier" else args.init_std
    if args.embed_init_std is not None:
        ctx["embed_init_std"] = None if args.embed_init_std == "follow" else args.embed_init_std
    elif args.init_std is not None:  # --init-std alone sets every weight, the embeddings included
        ctx["embed_init_std"] = None
    print(f"reproduce {args.task}/{args.preset}: {len(train)} training examples, {len(test)} test, vocabulary "
          f"{len(tokenizer)}, {per_sentence:.1f} tokens/sentence -> {ctx['batch_size']} sentences per batch; "
          f"output {out}", flush=True)

    # dependencies first: a derived row needs its source row, a KD row needs the soft teacher
    order = []

    def need(name):
        row = task_rows[name]
        teacher = row.kd or is_mle_row(recipe.mle_stage, name)  # a KD row, or one trained with the teacher's budget
        deps = ([row.source] if row.source else []) + (["soft"] if teacher else [])
        for dep in deps + ([row.mle_row] if row.two_stage and recipe.mle_stage == "row" else []):
            need(dep)
        if name not in order:
            order.append(name)

    for name in wanted:
        need(name)
    if recipe.mle_stage == "row" and recipe.minutes is not None and any(task_rows[name].two_stage for name in order):
        raise ValueError(f"`--minutes` {recipe.minutes}: the {recipe.name} recipe's Eq. 1 rows continue the hybrid "
                         f"rows' training from its final checkpoint, which a wall-clock budget does not keep; "
                         f"allowed: a step budget (the recipe's, or --max-steps).")
    for name in order:
        done = name in results and (os.path.isdir(model_dir(ctx, name))
                                    or teacher_from_results(ctx, name, wanted, [task_rows[o] for o in order]))
        if done and not (args.force and name in wanted):
            cut = checkpointing.redo_begun(os.path.join(ctx["out"], "trainer", name))
            print(f"[{name}] done: {results[name]['metric']} {results[name]['score']} (skipped"
                  f"{'; a --force rerun was cut off part-way: --force resumes it' if cut else ''})", flush=True)
            continue
        if "soft" in order[:order.index(name)] and any(task_rows[other].kd for other in order):
            kd_data(ctx)  # the teacher's translations first (kept in --results-dir), before a later row trains
        print(f"[{name}] {task_rows[name].paper}", flush=True)
        results[name] = run_row(task_rows[name], ctx)
        r = results[name]
        print(f"[{name}] {r['metric']} {r['score']}, {r['sentences_per_s']} sentences/s, {r['steps']} steps, "
              f"{r['params']:,} parameters", flush=True)
        write_outputs(ctx)
    table = write_outputs(ctx)
    print(table, flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reproduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
