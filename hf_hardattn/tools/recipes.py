"""The recipes of ``reproduce`` (tooling, not runtime code): each task's presets (sizes, batch, schedule, budget:
:data:`PRESETS`), and each paper's recipe on a preset's sizes (:data:`PAPER_RECIPES`, :func:`recipe_for`), trained to
convergence (:data:`CONVERGENCE`). :mod:`hf_hardattn.tools.reproduce` trains the rows with them."""

from __future__ import annotations

import copy
import dataclasses

TASKS = ("multi30k", "nouns")
PRESET_NAMES = ("cpu", "small", "base", "tiny")


@dataclasses.dataclass
class Recipe:
    """Everything shared by the rows of one task + preset."""

    dims: dict
    rnn: dict  # hybrid / beam-joint RNN decoder: rnn_hidden_size, rnn_embedding_size
    tokenizer: dict  # train_tokenizer arguments
    minutes: float | None  # wall-clock training budget per row
    max_steps: int | None  # step budget per row (the earlier of the two ends training)
    max_tokens: int  # approximate tokens per batch (sentences per batch = max_tokens / mean length)
    learning_rate: float
    warmup_steps: int
    label_smoothing: float = 0.1
    lr_scheduler: str = "inverse_sqrt"  # training.SCHEDULES; "linear" with only `minutes` decays to 0 at the budget's end
    bf16: bool = False  # bf16 autocast training (fp32 weights); on CPU it needs AMX / AVX512-BF16 to be fast
    num_beams: int = 4
    eval_batch_size: int = 64
    eval_size: int | None = None  # test examples scored (None = the whole test set)
    max_length: int = 128
    max_examples: int | None = None  # nouns: examples taken before the split by lemma
    # the embeddings' init (config embed_init_std): "model" = each model type's default (0.02: soft, hard retrieval,
    # recurrent, beam-joint Transformer; None: Gaussian, hybrid, beam-joint RNN); None = as init_std says. Nouns keeps
    # None: 0.02 measured lower there for every type (benchmarks/README.md)
    embed_init_std: float | str | None = "model"
    # -- the fields a paper's recipe (PAPER_RECIPES) sets; each default is today's recipe --
    name: str = "today"  # "today" or the paper's recipe (a key of PAPER_RECIPES)
    init_std: float | str | None = "model"  # config init_std of every hf_hardattn row; "model": each type's default
    attention_dropout: float | None = None  # config attention_dropout; None: the model's default (0)
    retrieval_dropout: str | None = None  # hard retrieval's dropout placement (config); None: the default, after_draw
    average_checkpoints: int = 0  # N > 0: the row's model is the mean of its last N checkpoints, checkpoint_steps apart
    checkpoint_steps: int | None = None  # None: at every evaluation (eval_steps)
    patience: int | None = None  # stop after this many evaluations (eval_steps apart) without improvement; None: budget
    patience_metric: str = "val_loss"  # training.PATIENCE_METRICS: the validation split's loss, or its BLEU
    # the metric of a stage that trains on the teacher's translations (a KD row's stage 2); None: patience_metric
    kd_patience_metric: str | None = None
    eval_steps: int | None = None
    mle_stage: str = "half"  # hybrid_*_kd_eq1 rows: see MLE_STAGES
    distill_beams: int = 4  # beam of the teacher's translations (the KD data)


PRESETS = {
    "multi30k": {
        "cpu": Recipe(
            dims=dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, dropout=0.1),
            rnn=dict(rnn_hidden_size=256, rnn_embedding_size=256),
            tokenizer=dict(kind="bpe", vocab_size=8000), minutes=35.0, max_steps=None, max_tokens=4096,
            learning_rate=5e-4, warmup_steps=1000, lr_scheduler="linear", bf16=True),
        "base": Recipe(
            dims=dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                      decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, dropout=0.1),
            rnn=dict(rnn_hidden_size=1024, rnn_embedding_size=512),
            tokenizer=dict(kind="bpe", vocab_size=8000), minutes=None, max_steps=20000, max_tokens=4096,
            learning_rate=5e-4, warmup_steps=4000),
    },
    "nouns": {
        "cpu": Recipe(
            dims=dict(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, dropout=0.1),
            rnn=dict(rnn_hidden_size=128, rnn_embedding_size=128),
            tokenizer=dict(kind="char", vocab_size=300, min_frequency=2), minutes=3.0, max_steps=None,
            max_tokens=1024, learning_rate=2e-3, warmup_steps=200, eval_batch_size=250, eval_size=2000,
            max_length=64, max_examples=60_000, embed_init_std=None),
        "base": Recipe(
            dims=dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                      decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, dropout=0.1),
            rnn=dict(rnn_hidden_size=1024, rnn_embedding_size=512),
            tokenizer=dict(kind="char", vocab_size=300, min_frequency=2), minutes=None, max_steps=20000,
            max_tokens=4096, learning_rate=5e-4, warmup_steps=4000, eval_batch_size=250, eval_size=None,
            max_length=64, embed_init_std=None),
    },
}
TINY = Recipe(dims=dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.1),
              rnn=dict(rnn_hidden_size=32, rnn_embedding_size=32), tokenizer=dict(kind="bpe", vocab_size=300),
              minutes=None, max_steps=3, max_tokens=256, learning_rate=1e-3, warmup_steps=2, eval_batch_size=8,
              eval_size=8, max_length=32, max_examples=2000)
PRESETS["multi30k"]["tiny"] = TINY
# "small": for a shared or slow CPU (on 2 cores shared with other jobs, 2026-11-25, the cpu preset's marian row made
# 95 steps in 35 minutes, BLEU 0.02): the nouns cpu preset's sizes, ~1k-token batches, fp32, 20 minutes per row
PRESETS["multi30k"]["small"] = dataclasses.replace(
    PRESETS["multi30k"]["cpu"], dims=dict(PRESETS["nouns"]["cpu"].dims), rnn=dict(PRESETS["nouns"]["cpu"].rnn),
    minutes=20.0, max_tokens=1024, learning_rate=1e-3, warmup_steps=200, bf16=False)
PRESETS["nouns"]["small"] = PRESETS["nouns"]["cpu"]  # already that size
PRESETS["nouns"]["tiny"] = dataclasses.replace(TINY, tokenizer=dict(kind="char", vocab_size=300, min_frequency=1),
                                               embed_init_std=None)

# The hybrid Eq. 1 rows' MLE stage: "half" (today: MLE for half the row's budget, then Eq. 1 for the other half, each
# stage a new optimizer with the preset's schedule compressed onto it), "teacher" (the MLE stage gets the teacher's
# budget, at least as many steps as the soft teacher took, then Eq. 1 continues its optimizer and schedule) or "row"
# (as "teacher", with the MLE stage being the hybrid_* row itself: that row trains with the teacher's budget and keeps
# its optimizer, and each Eq. 1 row continues it, the paper's fine-tuning of the same model; the same weights as
# "teacher" for one training less per Eq. 1 row)
MLE_STAGES = ("half", "teacher", "row")

# Convergence under a paper's recipe, per preset: a cap (max_steps), the evaluation interval and the patience (in
# evaluations) of the rule on the validation loss (a recipe's kd_patience_metric for a KD stage); checkpoints (for
# averaging) at every evaluation
CONVERGENCE = {
    "cpu": dict(max_steps=12000, eval_steps=250, patience=5),
    "small": dict(max_steps=12000, eval_steps=250, patience=5),
    "base": dict(max_steps=100000, eval_steps=1500, patience=5),
    "tiny": dict(max_steps=6, eval_steps=1, patience=2),
}

# Each paper's recipe, as far as the paper and its authors' code state it (the preset gives sizes, batch, learning rate
# and warm-up); every row of the run takes it alike, the baseline included, and stores it. All of them train to
# convergence (CONVERGENCE) with the inverse-square-root schedule of Vaswani et al., which the papers follow and which
# does not depend on where training ends.
PAPER_RECIPES = {
    # Xu et al. (Sec. 4.1) and their code (hfxunlp/transformer): init of Xu et al. 2020a, attention dropout 0.1
    # (cnfg/base.py attn_drop = drop) before the draw (modules/attn/retr.py), the average of the last 5 checkpoints
    "hard_retrieval": dict(fields=dict(init_std="lipschitz", embed_init_std=None, attention_dropout=0.1,
                                       retrieval_dropout="before_draw", label_smoothing=0.1, average_checkpoints=5),
                           rows=("soft", "hard_cross", "hard_self_cross", "hard_enc_dec", "soft_decoded_hard",
                                 "hard_decoded_soft")),
    # Wang, Wu & Liu (Sec. 2.2, 3.1): GRU 1024 over 512 embeddings, MLE then Eq. 1 fine-tuning of the same model, beam
    # 12 (the only beam the paper states), label smoothing 0.1 (Vaswani et al., which it follows). The paper keeps a
    # development set and states no stopping rule; Eq. 1's second term pulls the student towards the teacher's
    # translations and away from the references, so the references' loss rises while BLEU improves (Kim & Rush 2016:
    # sequence-level students have a higher perplexity), and the Eq. 1 stage stops on the validation BLEU
    "hybrid": dict(fields=dict(rnn="2x", mle_stage="row", distill_beams=12, label_smoothing=0.1,
                               kd_patience_metric="val_bleu"),
                   rows=("soft", "hybrid_additive", "hybrid_dot", "hybrid_multihead", "hybrid_additive_kd_eq1",
                         "hybrid_dot_kd_eq1", "hybrid_multihead_kd_eq1")),
    # Shankar, Garg & Sarawagi (Sec. 4): dropout 0.2, no label smoothing; not its SGD, batch 64, LSTM encoder
    "beam_joint": dict(fields=dict(dropout=0.2, label_smoothing=0.0),
                       rows=("soft", "rnn_luong_soft", "beam_joint_rnn_k6", "beam_joint_rnn_k6_decoded_k1",
                             "full_joint_rnn", "beam_joint_k6", "beam_joint_k6_decoded_k1")),
}
RECIPE_NAMES = ("today", *PAPER_RECIPES)


def recipe_for(task: str, preset: str, name: str = "today") -> Recipe:
    """The preset's recipe (``name`` "today") or a paper's (a key of :data:`PAPER_RECIPES`) on the preset's sizes."""
    if name not in RECIPE_NAMES:
        raise ValueError(f"`recipe` must be one of {RECIPE_NAMES}, got {name!r}.")
    recipe = copy.deepcopy(PRESETS[task][preset])
    if name == "today":
        return recipe
    fields = dict(PAPER_RECIPES[name]["fields"])
    if fields.pop("rnn", None) == "2x":  # the hybrid paper's decoder: hidden 2 x d_model over d_model embeddings
        d_model = recipe.dims["d_model"]
        fields["rnn"] = dict(rnn_hidden_size=2 * d_model, rnn_embedding_size=d_model)
    if "dropout" in fields:
        fields["dims"] = dict(recipe.dims, dropout=fields.pop("dropout"))
    convergence = CONVERGENCE[preset]
    return dataclasses.replace(recipe, name=name, minutes=None, lr_scheduler="inverse_sqrt", **convergence, **fields)
