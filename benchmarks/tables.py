"""Verdicts by a rule, and the results tables written from benchmarks/results.

    python benchmarks/tables.py            # writes results/verdicts.json, the generated regions (and the model
                                           # cards, whose verdict lines read verdicts.json, when it changed)
    python benchmarks/tables.py --check    # exits 1 with a diff where a committed one differs from what it writes

CLAIMS lists every paper claim of the README's results tables: the paper (000 hard retrieval, 001 beam-joint, 002
hybrid, 003 hard-coded Gaussian, 004 recurrent), the claim, the paper's bound on our measure, and the evidence it
is judged on (reproduce rows for quality, timed rounds for speed). The rule, per evidence and per set:

- quality: the paired difference A - B per seed (same seed, same set; benchmarks/compare_rows.py pairs them), its
  mean and the 90% two-sided Student t interval, mean +- t(0.95, n - 1) * sd / sqrt(n);
- speed: per timed round (the models alternate within each round), log(time B / time A) for a speed-up, or
  log(time A / time B) for a cost; the same interval on the logs, shown as ratios (exp of mean and ends);
- the word: **holds** when the interval lies inside the paper's bound, **no** when it lies wholly outside it, **not
  told apart (n seeds)** otherwise; one seed (or one timed figure) gives no interval and no verdict ("one seed");
- over the sets: the word every set gives, or "split" naming each set's word.

Every verdict says its recipe: ours (a fixed step budget, the last checkpoint; `converged` false) or "paper (NAME)":
rows of ``reproduce.py --recipe NAME`` (PaperRows), found by their ``recipe_name`` in any reproduce JSON under
results/ (today's layout: ``paper_RECIPE_TASK_KIND_sN/reproduce_TASK_PRESET_RECIPE.json``), one group per task, preset
and machine, never pooled with another recipe's rows; `converged` is true only where every row's ``convergence``
record (every stage's; a decoded row's, its source row's) says converged. The output is results/verdicts.json and the
regions between ``<!-- tables.py: NAME -->`` and ``<!-- /tables.py -->`` in README.md and docs/results.md: the README
has one row per claim, its headline evidence (headline_key: a group of converged paper-recipe rows with three or more
seeds first, as a verdict is earned at convergence with the paper's recipe; then the paper's task for the claim,
the most seeds, the longest training, today's default init; for speed, timed rounds on the paper's device, then the
most rounds) with the other groups' words and a link to docs/results.md, whose generated tables hold every group (the
headline marked) and every set's per-seed differences. The README's status line counts the quality verdicts that
rest on such rows.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_rows  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VERDICTS = os.path.join(RESULTS, "verdicts.json")
README = os.path.join(ROOT, "README.md")
DOCS_RESULTS = os.path.join(ROOT, "docs", "results.md")
ORIGINS = os.path.join(RESULTS, "ORIGINS.md")
LEVEL = 0.90

# Student t quantiles t(0.95, df) for df 1..30: the 90% two-sided interval's factor. Values of the standard t table
# (e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, "Critical values of Student's t
# distribution", column 0.05); tests/test_tables.py checks each against a numerical integration of the t density.
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740, 18: 1.734, 19: 1.729, 20: 1.725,
       21: 1.721, 22: 1.717, 23: 1.714, 24: 1.711, 25: 1.708, 26: 1.706, 27: 1.703, 28: 1.701, 29: 1.699, 30: 1.697}


def t_quantile(df: int) -> float:
    """t(0.95, df); above 30 degrees of freedom the normal quantile 1.645 (at most 3% below the t's)."""
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"df={df!r}: degrees of freedom must be an integer >= 1 (two or more seeds or rounds).")
    return T95[df] if df in T95 else statistics.NormalDist().inv_cdf(0.95)


def interval(values) -> dict:
    """Mean and 90% t interval of paired differences: mean +- t(0.95, n - 1) * sd / sqrt(n); one value: no interval."""
    values = list(values)
    if not values:
        raise ValueError("values=[]: an interval needs at least one paired difference.")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return dict(n=1, mean=mean, low=None, high=None)
    half = t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return dict(n=len(values), mean=mean, low=mean - half, high=mean + half)


@dataclass(frozen=True)
class Bound:
    """The paper's claim as a region of our measure: ``low <= measure <= high`` (None: unbounded on that side)."""
    low: float | None = None
    high: float | None = None

    def __post_init__(self):
        if self.low is None and self.high is None:
            raise ValueError("Bound(low=None, high=None): a bound needs low, high or both.")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"Bound(low={self.low}, high={self.high}): low must not exceed high.")

    def text(self, unit="") -> str:
        if self.high is None:
            return f">= {self.low:g}{unit}"
        if self.low is None:
            return f"<= {self.high:g}{unit}"
        return f"between {self.low:g} and {self.high:g}{unit}"


def word(low, high, bound: Bound, n: int, unit="seed") -> str:
    """holds (the interval inside the bound), no (wholly outside), not told apart (n seeds); one value: no verdict."""
    if low is None:
        return f"one {unit}"
    inside_low = bound.low is None or low >= bound.low
    inside_high = bound.high is None or high <= bound.high
    if inside_low and inside_high:
        return "holds"
    if (bound.low is not None and high < bound.low) or (bound.high is not None and low > bound.high):
        return "no"
    return f"not told apart ({n} {unit}s)"


def overall(words: dict) -> str:
    """The verdict over the sets: the word every set gives, else 'split' with each set's word."""
    distinct = list(dict.fromkeys(words.values()))
    if len(distinct) == 1:
        return distinct[0]
    return "split: " + ", ".join(f"{w} on {s}" for s, w in words.items())


# ----------------------------------------------------------------------------------------------- the claims
@dataclass(frozen=True)
class Rows:
    """Quality evidence: reproduce rows A@INIT and B@INIT from the files matching ``files`` (under results/)."""
    label: str
    files: tuple
    a: str
    b: str
    note: str = ""


@dataclass(frozen=True)
class PaperRows:
    """Quality evidence trained with a paper's recipe (``reproduce.py --recipe NAME``, to convergence): rows A and B
    of every result file under results/ whose ``recipe_name`` is ``recipe``, wherever it lies; one group per task,
    preset and machine (paper_groups). No file, or no seed with both rows yet: no group (the runs have not landed)."""
    recipe: str
    a: str
    b: str
    setting: str = ""  # the model setting where a claim has two ("Luong LSTM", "Transformer"), as the labels name it
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.setting + ', ' if self.setting else ''}paper's recipe ({self.recipe})"


@dataclass(frozen=True)
class Rounds:
    """Speed evidence: timed rounds of A and B in a JSON section ("decoding" or "training") of gpu_speed.py, or
    "training" of recurrent_speed.py; a file without a ``protocol`` names where its rounds are documented as
    interleaved (``interleaved``) and its precision."""
    label: str
    file: str
    section: str
    a: str
    b: str
    batches: tuple = ()  # decoding: only these batch sizes (empty: all)
    note: str = ""
    interleaved: str = ""
    precision: str = ""


@dataclass(frozen=True)
class Figures:
    """CPU speed figures with no timed rounds stored (one figure per setting): shown, never judged."""
    label: str
    files: tuple
    ratio: str  # decoding: a key of the rows' "ratios"; training: "ROW x_soft" or "ROW x_hybrid"
    note: str = ""
    precision: str = "fp32"  # the weights' (int8: int8 weights, activations quantised at every call)


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    claim: str
    bound: Bound
    kind: str  # "quality" (A - B, BLEU or exact match points) or "speed" / "cost" (a ratio)
    evidence: tuple = field(default_factory=tuple)
    device: str | None = None  # speed and cost: "GPU" where the paper's figure is of a GPU (the headline rule)
    task: str | None = "multi30k"  # quality: the task the paper made the claim on (translation: our Multi30k; None:
    # the paper made it on translation and on nouns alike) - the headline rule prefers its rows

    def __post_init__(self):
        if self.device not in (None, "GPU"):
            raise ValueError(f"Claim {self.id}: device={self.device!r}; allowed: 'GPU' (the paper timed a GPU) "
                             f"or None.")
        if self.task not in (None, "multi30k", "nouns"):
            raise ValueError(f"Claim {self.id}: task={self.task!r}; allowed: 'multi30k' (translation), 'nouns' "
                             f"or None (both).")


H200_EMB = "xavier, emb N(0,0.02)"
EMB = "init_emb_h200/multi30k-emb0.02-s[01]-{}/reproduce_multi30k_cpu.json"
INIT002 = "init_h200/multi30k-0.02-s[01]-{}/reproduce_multi30k_cpu.json"
SEEDS = "seeds_h200/multi30k-default-s*-{}/reproduce_multi30k_cpu.json"
BF16_3267 = ("multi30k_bf16_3267_steps_epyc_avx512*/reproduce_multi30k_cpu.json",)
H200_1500 = ("multi30k_fp32_1500_steps_h200/reproduce_multi30k_cpu.json",
             "multi30k_fp32_1500_steps_h200_seed1/reproduce_multi30k_cpu.json")
MIN35 = ("multi30k_bf16_35min_intel_amx/reproduce_multi30k_cpu.json",)
NOUNS3 = ("nouns_fp32_3min_intel_amx/reproduce_nouns_cpu.json",)
NOUNS_BJ = ("nouns_fp32_1774_steps_beam_joint_rnn_epyc_avx512/reproduce_nouns_cpu.json",)
GPU = "gpu_speed_nvidia_h200.json"
GPU512 = "gpu_speed_nvidia_h200_decoding_b512.json"
GPU_COMPILED = "gpu_speed_nvidia_h200_compiled.json"  # static cache + compiled steps with CUDA graphs, and eager
GPU_COMPILED_B1 = "gpu_speed_nvidia_h200_compiled_greedy_b1.json"  # the same at greedy batch 1, 15 rounds
CUDA_GRAPHS = "Transformer-base, random weights, static cache + compiled steps (CUDA graphs)"
CPU_DECODE = ("decode_speed_intel_amx.json", "decode_speed_epyc_avx2_grouped.json",
              "decode_speed_epyc_avx512_grouped.json")
CPU_COMPILED = ("decode_speed_packed_compiled_epyc_avx512.json",)  # packed weights + static cache + compiled steps
COMPILED = "Transformer-base, random weights, packed + compiled (the per-step overhead gone)"
CPU_INT8_COMPILED = ("decode_speed_int8_mechanisms_compiled_epyc_avx512.json",)  # int8 (traced engine) + compiled
INT8_COMPILED = "Transformer-base, random weights, traced int8 engine + compiled (the per-step overhead gone)"
HYBRIDS = ("additive", "dot", "multihead")  # the hybrid recipe's rows' cross-attention (reproduce.py PAPER_RECIPES)
CPU_TRAIN = ("train_speed_intel_amx.json", "train_speed_epyc_avx2.json", "train_speed_epyc_avx512.json")


def pair(label, pattern, a, b, a_init=H200_EMB, b_init=H200_EMB, note=""):
    files = tuple(pattern.format(row) for row in (a, b))
    return Rows(label, files, f"{a}@{a_init}", f"{b}@{b_init}", note)


CLAIMS = [
    Claim("000-hard-cross", "000", "hard cross-attention within 0.5 BLEU of soft (Table 3)", Bound(low=-0.5), "quality", (
        PaperRows("hard_retrieval", "hard_cross", "soft"),
        pair("default init", EMB, "hard_cross", "soft"),
        Rows("default init", ("default_init_cpu_epyc_avx2/*-s[01]-{hard_cross,soft}/reproduce_multi30k_cpu.json",),
             f"hard_cross@{H200_EMB}", f"soft@{H200_EMB}"),
        pair("N(0, 0.02) everywhere", INIT002, "hard_cross", "soft", "N(0,0.02)", "N(0,0.02)"),
        Rows("earlier init", BF16_3267, "hard_cross@xavier", "soft@xavier"),
    )),
    Claim("000-hard-self-cross", "000", "hard decoder self + cross within 0.5 BLEU of soft (Table 3)", Bound(low=-0.5),
          "quality", (
              PaperRows("hard_retrieval", "hard_self_cross", "soft"),
              pair("default init", EMB, "hard_self_cross", "soft"),
              pair("N(0, 0.02) everywhere", INIT002, "hard_self_cross", "soft", "N(0,0.02)", "N(0,0.02)"),
              Rows("earlier init", BF16_3267, "hard_self_cross@xavier", "soft@xavier"),
          )),
    Claim("000-soft-decoded-hard", "000", "a soft-trained model decoded hard drops (Table 4: -1.25 BLEU)",
          Bound(high=-1.25), "quality", (
              PaperRows("hard_retrieval", "soft_decoded_hard", "soft"),
              Rows("earlier init", MIN35, "soft_decoded_hard@xavier", "soft@xavier"),
              Rows("earlier init", ("multi30k_fp32_1500_steps_epyc_avx512/reproduce_multi30k_cpu.json",),
                   "soft_decoded_hard@xavier", "soft@xavier"),
          )),
    Claim("000-hard-decoded-soft", "000", "a hard-trained model decoded soft does not drop (Table 4)", Bound(low=-0.5),
          "quality", (
              PaperRows("hard_retrieval", "hard_decoded_soft", "hard_self_cross"),
              Rows("earlier init", MIN35, "hard_decoded_soft@xavier", "hard_self_cross@xavier"),
          )),
    Claim("000-decoding-speed", "000", "hard retrieval decodes 1.43x as fast as soft (GPU)", Bound(low=1.43),
          "speed", (
              Rounds("Transformer-base, random weights", GPU, "decoding", "hard_retrieval", "soft"),
              Rounds("Transformer-base, random weights", GPU512, "decoding", "hard_retrieval", "soft", (512,)),
              Rounds(CUDA_GRAPHS, GPU_COMPILED_B1, "decoding", "hard_retrieval_compiled", "soft_compiled"),
              Rounds(CUDA_GRAPHS, GPU_COMPILED, "decoding", "hard_retrieval_compiled", "soft_compiled"),
              Figures("Transformer-base, random weights", CPU_DECODE, "hard_retrieval / soft"),
              Figures(COMPILED, CPU_COMPILED, "hard_retrieval_packed_compiled / soft_packed_compiled"),
              Figures(INT8_COMPILED, CPU_INT8_COMPILED,
                      "hard_retrieval_int8_traced_compiled / soft_int8_traced_compiled", precision="int8"),
          ), device="GPU"),
    Claim("003-hc-sa", "003", "hc-sa about equal to soft (Table 2: almost identical BLEU)", Bound(low=-0.5), "quality", (
        Rows("each type's default init", (SEEDS.format("hc_sa"), EMB.format("soft")), "hc_sa@xavier",
             f"soft@{H200_EMB}"),
        pair("N(0, 0.02) everywhere", INIT002, "hc_sa", "soft", "N(0,0.02)", "N(0,0.02)"),
    )),
    Claim("003-hc-all", "003", "hc-all far below soft (Table 2: -9.2 BLEU on IWSLT16)", Bound(high=-9.2), "quality", (
        Rows("earlier init", MIN35, "hc_all@xavier", "soft@xavier"),
    )),
    Claim("003-sh-x", "003", "sh-x 1-3 BLEU below soft (Table 2)", Bound(low=-3.0, high=-1.0), "quality", (
        Rows("each type's default init", (SEEDS.format("sh_x"), EMB.format("soft")), "sh_x@xavier",
             f"soft@{H200_EMB}"),
        pair("N(0, 0.02) everywhere", INIT002, "sh_x", "soft", "N(0,0.02)", "N(0,0.02)"),
    )),
    Claim("003-sh-x-speed", "003", "sh-x decodes 1.30x as fast as soft (Table 7, GPU, batch 256)", Bound(low=1.30),
          "speed", (
              Rounds("Transformer-base, random weights", GPU, "decoding", "sh_x", "soft"),
              Rounds("Transformer-base, random weights", GPU512, "decoding", "sh_x", "soft", (512,)),
              Rounds(CUDA_GRAPHS, GPU_COMPILED, "decoding", "sh_x_compiled", "soft_compiled"),
              Figures("Transformer-base, random weights", CPU_DECODE, "sh_x / soft"),
              Figures(COMPILED, CPU_COMPILED, "sh_x_packed_compiled / soft_packed_compiled"),
          ), device="GPU"),
    Claim("003-hc-sa-speed", "003", "hc-sa decodes 1.06x as fast as soft (Table 7, GPU, batch 256)", Bound(low=1.06),
          "speed", (
              Rounds("Transformer-base, random weights", GPU, "decoding", "hc_sa", "soft"),
              Rounds("Transformer-base, random weights", GPU512, "decoding", "hc_sa", "soft", (512,)),
              Rounds(CUDA_GRAPHS, GPU_COMPILED, "decoding", "hc_sa_compiled", "soft_compiled"),
              Figures("Transformer-base, random weights", CPU_DECODE[::2], "hc_sa / soft"),
          ), device="GPU"),
    Claim("002-below-teacher", "002", "the hybrid (6-1, RNN decoder) is below its Transformer teacher (Tables 2-3)",
          Bound(high=0.0), "quality", (
              *(PaperRows("hybrid", f"hybrid_{kind}", "soft") for kind in HYBRIDS),
              Rows("earlier init", MIN35, "hybrid_dot@xavier", "soft@xavier"),
              Rows("earlier init", ("multi30k_fp32_1500_steps_epyc/reproduce_multi30k_cpu.json",),
                   "hybrid_additive@xavier", "soft@xavier"),
              Rows("earlier init", NOUNS3, "hybrid_dot@xavier", "soft@xavier"),
          )),
    Claim("002-eq1-near-teacher", "002", "distillation (Eq. 1) brings the hybrid within 0.5 BLEU of its teacher",
          Bound(low=-0.5), "quality", (
              *(PaperRows("hybrid", f"hybrid_{kind}_kd_eq1", "soft") for kind in HYBRIDS),
              Rows("default init", ("default_init_cpu_epyc_avx2/*-s0-{soft,hybrid_additive_kd_eq1}/reproduce_*.json",
                                    "default_init_cpu_epyc_avx512/*-s1-soft-eq1/reproduce_*.json"),
                   "hybrid_additive_kd_eq1@xavier", f"soft@{H200_EMB}"),
              Rows("earlier init", ("multi30k_fp32_1500_steps_kd_eq1_epyc_avx512/reproduce_multi30k_cpu.json",),
                   "hybrid_additive_kd_eq1@xavier", "soft@xavier"),
              Rows("earlier init", ("nouns_fp32_2000_steps_kd_eq1_epyc_avx512/reproduce_nouns_cpu.json",),
                   "hybrid_dot_kd_eq1@xavier", "soft@xavier"),
          )),
    Claim("002-decoding-speed", "002", "6-1 decodes 4.1x as fast as the 6-6 teacher (GPU)", Bound(low=4.1), "speed", (
        Rounds("Transformer-base, random weights", GPU, "decoding", "hybrid_dot", "soft"),
        Rounds("Transformer-base, random weights", GPU512, "decoding", "hybrid_dot", "soft", (512,)),
        Rounds(CUDA_GRAPHS, GPU_COMPILED, "decoding", "hybrid_dot_compiled", "soft_compiled"),
        Figures("Transformer-base, random weights", CPU_DECODE, "hybrid_dot / soft"),
        Figures(COMPILED, CPU_COMPILED, "hybrid_dot_packed_compiled / soft_packed_compiled"),
        Figures(INT8_COMPILED, CPU_INT8_COMPILED, "hybrid_dot_int8_traced_compiled / soft_int8_traced_compiled",
                precision="int8"),
    ), device="GPU"),
    Claim("004-about-equal", "004", "the recurrent variants about equal to soft (Table 2: no significant gain)",
          Bound(low=-0.5, high=0.5), "quality", (
              pair("default init", EMB, "recurrent_concat_weight", "soft"),
              pair("default init", EMB, "recurrent_expand_1", "soft"),
              Rows("earlier init", NOUNS3, "recurrent_concat_weight@xavier", "soft@xavier"),
              Rows("earlier init", NOUNS3, "recurrent_expand_1@xavier", "soft@xavier"),
          )),
    Claim("004-training-cost", "004", "training 5.4-7.9x soft's time (Table 2; a cost)", Bound(low=5.4), "cost", (
        Rounds("Transformer-base, random weights, batch 64", GPU, "training", "recurrent_concat_context", "soft"),
        Rounds("Transformer-base, random weights, batch 64", GPU, "training", "recurrent_expand_1", "soft"),
        Rounds("d 256, 3+3 layers, batch 64", "recurrent_speed_intel_amx.json", "training", "concat_context", "soft",
               interleaved="benchmarks/recurrent_speed.py (one step of every model per round)", precision="fp32"),
        Rounds("d 256, 3+3 layers, batch 64", "recurrent_speed_intel_amx.json", "training", "expand_1", "soft",
               interleaved="benchmarks/recurrent_speed.py (one step of every model per round)", precision="fp32"),
        Figures("d 256, 3+3 layers, batch 128", CPU_TRAIN, "recurrent_concat_context x_soft"),
    )),
    Claim("001-rnn-above-soft", "001", "beam-joint (K=6) above soft, the paper's RNN setting (Table 1)",
          Bound(low=0.0), "quality", (
              PaperRows("beam_joint", "beam_joint_rnn_k6", "rnn_luong_soft", "Luong LSTM"),
              pair("Luong LSTM, earlier init", SEEDS, "beam_joint_rnn_k6", "rnn_luong_soft", "xavier", "xavier"),
              Rows("Luong LSTM, earlier init", NOUNS_BJ, "beam_joint_rnn_k6@xavier", "rnn_luong_soft@xavier"),
          )),
    Claim("001-transformer-above-soft", "001", "beam-joint (K=6) above soft, Transformer setting (the paper's "
          "future work)", Bound(low=0.0), "quality", (
              PaperRows("beam_joint", "beam_joint_k6", "soft", "Transformer"),
              pair("default init", EMB, "beam_joint_k6", "soft"),
              Rows("earlier init", H200_1500, "beam_joint_k6@xavier", "soft@xavier"),
              Rows("earlier init, 3 minutes each (unequal steps)", NOUNS3, "beam_joint_k6@xavier", "soft@xavier"),
          )),
    Claim("001-k1-above-soft", "001", "decoded with K=1: still above soft (Table 2)", Bound(low=0.0), "quality", (
        PaperRows("beam_joint", "beam_joint_rnn_k6_decoded_k1", "rnn_luong_soft", "Luong LSTM"),
        PaperRows("beam_joint", "beam_joint_k6_decoded_k1", "soft", "Transformer"),
        Rows("Luong LSTM, earlier init", H200_1500, "beam_joint_rnn_k6_decoded_k1@xavier", "rnn_luong_soft@xavier"),
        Rows("Transformer, earlier init", H200_1500, "beam_joint_k6_decoded_k1@xavier", "soft@xavier"),
        Rows("Luong LSTM, earlier init", NOUNS_BJ, "beam_joint_rnn_k6_decoded_k1@xavier", "rnn_luong_soft@xavier"),
    )),
    Claim("001-full-joint", "001", "full-joint above soft (Fig. 1a, de-N)", Bound(low=0.0), "quality", (
        PaperRows("beam_joint", "full_joint_rnn", "rnn_luong_soft", "Luong LSTM"),
        Rows("Luong LSTM, earlier init (full-joint at fewer steps)", NOUNS_BJ, "full_joint_rnn@xavier",
             "rnn_luong_soft@xavier"),
    ), task=None),  # En-Vi (Fig. 1a) and German nouns (de-N) alike
    Claim("001-training-cost", "001", "training only 20-30% slower than soft (GPU; a cost)", Bound(high=1.30), "cost", (
        Rounds("Transformer setting, Transformer-base, batch 64", GPU, "training", "beam_joint_k6", "soft"),
        Rounds("Luong LSTM setting, against the same LSTM with soft attention, batch 64", GPU, "training",
               "beam_joint_rnn_k6", "hybrid_rnn_soft"),
        Figures("Transformer setting, d 256, 3+3 layers, batch 128", CPU_TRAIN, "beam_joint_k6 x_soft"),
    ), device="GPU"),
]
BASELINE = Claim("baseline-marian", "baseline", "our soft at or above MarianMTModel of the same size (level: >= -0.5)",
                 Bound(low=-0.5), "quality", (
                     Rows("each type's default init", (EMB.format("soft"), EMB.format("marian"),
                                                       SEEDS.format("soft"), SEEDS.format("marian")),
                          f"soft@{H200_EMB}", "marian@N(0,0.02)"),
                 ))
TABLES = {"000": "Hard retrieval (Xu et al.)", "003": "Hard-coded Gaussian (You, Sun & Iyyer)",
          "002": "Hybrid: self-attention encoder + RNN decoder (Wang, Wu & Liu)",
          "004": "Recurrent cross-attention (Rosendahl et al.)",
          "001": "Beam-joint attention (Shankar, Garg & Sarawagi)"}


# ----------------------------------------------------------------------------------------------- the evidence
def files_of(patterns) -> list[str]:
    """The result files matching the patterns (brace alternatives {a,b} expanded), sorted; none is an error."""
    found = []
    for pattern in patterns:
        expanded = [pattern]
        while any("{" in p for p in expanded):
            p = next(p for p in expanded if "{" in p)
            head, rest = p.split("{", 1)
            options, tail = rest.split("}", 1)
            expanded.remove(p)
            expanded += [head + option + tail for option in options.split(",")]
        for p in expanded:
            matches = sorted(glob.glob(os.path.join(RESULTS, p)))
            if not matches:
                raise ValueError(f"files={pattern!r}: no result file matches {p!r} under {RESULTS}.")
            found += matches
    return sorted(dict.fromkeys(found))


def rel(path) -> str:
    return os.path.relpath(path, RESULTS).replace(os.sep, "/")


def traced_machine(path) -> str:
    """The machine results/ORIGINS.md traces a file without a stored ``machine`` to ("Intel AMX, traced")."""
    with open(ORIGINS) as handle:
        for line in handle:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) > 2 and f"`{rel(path)}`" in cells[0]:
                return f"{cells[2]} (traced)"
    raise ValueError(f"{rel(path)}: rows without a `machine` and no line for the file in {ORIGINS}.")


def machine_name(machine: dict | None, path) -> str:
    """The machine as benchmarks/README.md names it: H200, AVX2 EPYC, AVX512 EPYC, Intel AMX (traced)."""
    if machine is None:
        return traced_machine(path)
    if machine.get("gpu"):
        return machine["gpu"].replace("NVIDIA ", "")
    maker = "EPYC" if "EPYC" in machine["cpu"] else machine["cpu"]
    return f"{machine['cpu_capability']} {maker}"


def precision_of(row, payload) -> str:
    words = row.get("command", "").split()
    if "--precision" in words:
        return words[words.index("--precision") + 1]
    recipe = row.get("recipe") or payload["recipe"]
    return "bf16" if recipe.get("bf16") else "fp32"


def rounds_text(rounds) -> str:
    """Counts of timed rounds in words: "1 round", "15 rounds", "7 / 15 rounds"."""
    return f"{joined(rounds)} round{'' if list(rounds) == [1] else 's'}"


def joined(values) -> str:
    return " / ".join(str(v) for v in dict.fromkeys(values))


def seeds_text(seeds) -> str:
    seeds = sorted(seeds)
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(str(s) for s in seeds)


LABEL_SMOOTHING_IN_CONFIG = ("beam_joint", "full_joint", "rnn_luong_soft")
SET_NAMES = {"test_2016_flickr": "test", "val": "val", "test": "nouns test"}


def convergence_records(row, rows) -> list[dict]:
    """A row's convergence records (reproduce.py): its ``convergence``, one record or one per stage of a two-stage
    row; a row that decodes another row's model (``decoded_from``) has that row's, the same seed in the same file;
    none (``[]``): trained to a fixed budget."""
    record = row.get("convergence")
    if record is None and row.get("decoded_from"):
        sources = [r for r in rows if r["file"] == row["file"] and r["row"] == row["decoded_from"]
                   and r["seed"] == row["seed"]]
        if len(sources) != 1:
            raise ValueError(f"{rel(row['file'])}: row {row['row']} (seed {row['seed']}) decodes "
                             f"{row['decoded_from']}'s model, which the file holds {len(sources)} times; its "
                             f"convergence is that row's, so exactly one is needed.")
        return convergence_records(sources[0], rows)
    if record is None:
        return []
    return [record] if "converged" in record else list(record.values())


def row_converged(row, rows) -> bool:
    """True only where the row's convergence records (every stage's) say converged; a stored ``converged`` flag that
    disagrees with them is an error."""
    records = convergence_records(row, rows)
    converged = bool(records) and all(record.get("converged") is True for record in records)
    if "converged" in row and row["converged"] is not converged:
        raise ValueError(f"{rel(row['file'])}: row {row['row']} (seed {row['seed']}) has converged="
                         f"{row['converged']!r} but its convergence records say {converged} "
                         f"({len(records)} record(s)); they must agree.")
    return converged


def judge_rows(claim: Claim, evidence: Rows) -> dict:
    """One verdict entry from reproduce rows: paired differences A - B per seed and set, interval, word."""
    sides = [tuple(side.split("@", 1)) for side in (evidence.a, evidence.b)]
    return judge_pairs(claim, evidence.label, evidence.note, files_of(evidence.files), sides, evidence.files)


def paper_groups(evidence: PaperRows) -> list[list[str]]:
    """The result files of rows trained with ``evidence.recipe``: every ``reproduce_*.json`` under results/ whose
    ``recipe_name`` (the file's or one of its rows') is the recipe and which holds row A or B, grouped by task,
    preset and the rows' machine (two machines' seeds are not pooled: each its own group)."""
    groups = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "**", "reproduce_*.json"), recursive=True)):
        with open(path) as handle:
            payload = json.load(handle)
        rows = [row for row in payload.get("rows", {}).values() if row.get("row") in (evidence.a, evidence.b)]
        names = {payload.get("recipe_name")} | {row.get("recipe_name") for row in rows}
        if not rows or evidence.recipe not in names:
            continue
        machines = joined(sorted({machine_name(row.get("machine"), path) for row in rows}))
        groups.setdefault((payload["task"], payload["preset"], machines), []).append(path)
    return [paths for _, paths in sorted(groups.items())]


def judge_paper(claim: Claim, evidence: PaperRows) -> list[dict]:
    """One verdict entry per group of paper_groups with a seed holding both rows (none yet: no entry)."""
    out = []
    for paths in paper_groups(evidence):
        rows = [row for row in compare_rows.load_rows(paths) if row["row"] in (evidence.a, evidence.b)]
        seeds = [{row["seed"] for row in rows if row["row"] == name} for name in (evidence.a, evidence.b)]
        if not seeds[0] & seeds[1]:
            continue  # no seed has both rows yet
        sides = []
        for name in (evidence.a, evidence.b):
            inits = sorted({compare_rows.row_init(row) for row in rows if row["row"] == name})
            if len(inits) != 1:
                raise ValueError(f"claim {claim.id} ({evidence.label}): row {name} with inits {inits} in "
                                 f"{[rel(p) for p in paths]}; one recipe gives a row one init.")
            sides.append((name, inits[0]))
        out.append(judge_pairs(claim, evidence.label, evidence.note, paths, sides, [rel(p) for p in paths]))
    return out


def judge_pairs(claim: Claim, label: str, note: str, paths, sides, where) -> dict:
    """The verdict entry of rows ``sides`` [(A, init), (B, init)] in the files ``paths`` (named ``where``)."""
    names = {name for name, _ in sides}
    payloads = {path: json.load(open(path)) for path in paths}
    loaded = compare_rows.load_rows(paths)
    rows = [row for row in loaded if row["row"] in names]
    groups = compare_rows.group(rows)
    for side in sides:
        if side not in groups:
            raise ValueError(f"claim {claim.id}: no row {side[0]} with init {side[1]!r} in {where} "
                             f"(found {sorted(groups)}).")
    differences = compare_rows.differences(groups[sides[0]], groups[sides[1]])
    used = [row for row in rows if (row["row"], compare_rows.row_init(row)) in sides
            and row["seed"] in {s for d in differences.values() for s in d}]
    sets, words, seeds = {}, {}, set()
    metric_keys = [key for key in differences if key[0] != "chrF"]
    if not metric_keys:
        raise ValueError(f"claim {claim.id}: {'@'.join(sides[0])} and {'@'.join(sides[1])} share no seed in "
                         f"{where}.")
    for metric, split in metric_keys:
        per_seed = differences[(metric, split)]
        result = interval(per_seed.values())
        name = SET_NAMES.get(split, split)
        w = word(result["low"], result["high"], claim.bound, result["n"])
        sets[name] = dict(metric=metric, seeds=sorted(per_seed), differences=[round(per_seed[s], 2) for s in
                                                                               sorted(per_seed)],
                          mean=round(result["mean"], 3), interval=None if result["low"] is None
                          else [round(result["low"], 3), round(result["high"], 3)], word=w)
        words[name] = w
        seeds |= set(per_seed)
    steps = sorted({row["steps"] for row in used})
    machines = [machine_name(row.get("machine"), row["file"]) for row in used]
    precisions = [precision_of(row, payloads[row["file"]]) for row in used]
    smoothing = sorted({(row.get("recipe") or payloads[row["file"]]["recipe"]).get("label_smoothing") for row in used},
                       key=str)
    # beam-joint and rnn_luong_soft rows set label smoothing in their config (reproduce.py); the JSON stores only the
    # recipe's, so their smoothing is not on record
    unstored = sorted({row["row"] for row in used if row["row"].startswith(LABEL_SMOOTHING_IN_CONFIG)})
    smoothing_text = (f"label smoothing {joined(smoothing)}" if not unstored else
                      f"label smoothing: recipe {joined(smoothing)}, the config's of {', '.join(unstored)} not stored")
    # rows pool only under one recipe (rows written before recipes had names ran ours: None, as "today")
    recipe_names = sorted({row.get("recipe_name") or "today" for row in used})
    if len(recipe_names) > 1:
        raise ValueError(f"claim {claim.id} ({label}): rows of recipes {recipe_names} pooled; a verdict "
                         f"rests on rows of one recipe.")
    inits = (sides[0][1] if sides[0][1] == sides[1][1] else f"{sides[0][0]}: {sides[0][1]}; {sides[1][0]}: "
             f"{sides[1][1]}")
    budget = f"{joined(steps)} steps" if all(payloads[r["file"]]["recipe"].get("max_steps") or
                                             "--max-steps" in r.get("command", "") for r in used) else \
        f"{joined(f'{m:g}' for m in sorted({float(payloads[r['file']]['recipe']['minutes']) for r in used}))} minutes " \
        f"({joined(steps)} steps)"
    return dict(
        id=claim.id, paper=claim.paper, claim=claim.claim, bound=claim.bound.text(),
        measure=" - ".join("@".join(side) for side in sides), evidence=label, verdict=overall(words),
        seeds=sorted(seeds), sets=sets,
        recipe=(f"paper ({recipe_names[0]})" if recipe_names[0] not in (None, "today") else
                f"ours: {label} ({inits}), {budget}, {smoothing_text}, last checkpoint"),
        converged=all(row_converged(row, loaded) for row in used), machine=joined(machines),
        precision=joined(precisions), steps=steps, task=joined(row["task"] for row in used), note=note,
        rows=[dict(file=rel(row["file"]), row=row["row"], seed=row["seed"]) for row in
              sorted(used, key=lambda r: (r["row"], r["seed"], rel(r["file"])))])


def setting_name(entry) -> str:
    return f"{entry['mode']} b{entry['batch_size']}"


def judge_rounds(claim: Claim, evidence: Rounds) -> dict:
    """One verdict entry from timed rounds: per round log(time B / time A) (speed) or log(time A / time B) (cost)."""
    path = files_of([evidence.file])[0]
    payload = json.load(open(path))
    if "alternate" not in payload.get("protocol", {}).get("interleaved", "") and not evidence.interleaved:
        raise ValueError(f"{evidence.file}: rounds are paired only where the models alternate within each round.")
    section = payload[evidence.section]
    if isinstance(section, dict) and "models" not in section:  # recurrent_speed.py: {model: {times_s: ...}}
        section = dict(models=section)
    entries = section if isinstance(section, list) else [dict(section, mode="training")]
    sets, words, rounds = {}, {}, set()
    for entry in entries:
        if evidence.batches and entry["batch_size"] not in evidence.batches:
            continue
        a, b = (entry["models"][name]["times_s"] for name in (evidence.a, evidence.b))
        if len(a) != len(b):
            raise ValueError(f"{evidence.file} {setting_name(entry)}: {len(a)} rounds of {evidence.a}, {len(b)} of "
                             f"{evidence.b}; rounds pair only one to one.")
        logs = [math.log(tb / ta) if claim.kind == "speed" else math.log(ta / tb) for ta, tb in zip(a, b)]
        result = interval(logs)
        low, high = (None, None) if result["low"] is None else (math.exp(result["low"]), math.exp(result["high"]))
        w = word(low, high, claim.bound, result["n"], unit="round")
        name = "training step" if evidence.section == "training" else setting_name(entry)
        sets[name] = dict(metric="time ratio" if claim.kind == "cost" else "speed ratio", rounds=len(logs),
                          mean=round(math.exp(result["mean"]), 3),
                          interval=None if low is None else [round(low, 3), round(high, 3)], word=w)
        words[name] = w
        rounds.add(len(logs))
    precision = payload["precision"]["name"] if "precision" in payload else evidence.precision
    machine = (payload["environment"]["gpu_name"].replace("NVIDIA ", "") if "environment" in payload
               else machine_name(payload.get("machine"), path))
    return dict(
        id=claim.id, paper=claim.paper, claim=claim.claim, bound=claim.bound.text("x"),
        measure=(f"time {evidence.b} / time {evidence.a}" if claim.kind == "speed"
                 else f"time {evidence.a} / time {evidence.b}"),
        evidence=evidence.label, verdict=overall(words), seeds=None, rounds=sorted(rounds), sets=sets,
        recipe=f"ours: {evidence.label}, {precision}, rounds interleaved (geometric mean ratio)"
               + (f"; interleaving: {evidence.interleaved}" if evidence.interleaved else ""), converged=None,
        machine=machine, precision=precision, steps=None,
        task="speed", note=evidence.note, rows=[dict(file=rel(path), section=evidence.section,
                                                       models=[evidence.a, evidence.b])])


def judge_figures(claim: Claim, evidence: Figures) -> dict:
    """CPU speed figures (one per setting, no rounds stored): their range per machine, no verdict."""
    sets, machines = {}, []
    for path in files_of(evidence.files):
        payload = json.load(open(path))
        machine = machine_name(payload.get("machine"), path)
        if " x_" in evidence.ratio:
            name, column = evidence.ratio.split(" ")
            values = [row[column] for row in payload["rows"] if row["row"] == name]
        else:
            values = [row["ratios"][evidence.ratio] for row in payload["rows"] if evidence.ratio in row["ratios"]]
        if not values:
            raise ValueError(f"{rel(path)}: no {evidence.ratio!r} figure.")
        sets[machine] = dict(metric=evidence.ratio, figures=[round(v, 3) for v in values], file=rel(path),
                             word="one figure per setting")
        machines.append(machine)
    return dict(
        id=claim.id, paper=claim.paper, claim=claim.claim, bound=claim.bound.text("x"), measure=evidence.ratio,
        evidence=evidence.label, verdict="not judged (no timed rounds stored)", seeds=None, sets=sets,
        recipe=f"ours: {evidence.label}, {evidence.precision}, 2 threads", converged=None, machine=joined(machines),
        precision=evidence.precision, steps=None, task="speed", note=evidence.note,
        rows=[dict(file=s["file"], ratio=evidence.ratio) for s in sets.values()])


def verdicts(claims=None) -> list[dict]:
    out = []
    for claim in (CLAIMS + [BASELINE] if claims is None else claims):
        for evidence in claim.evidence:
            if isinstance(evidence, PaperRows):  # one entry per group of the recipe's rows; none before they land
                out += judge_paper(claim, evidence)
                continue
            judge = {Rows: judge_rows, Rounds: judge_rounds, Figures: judge_figures}[type(evidence)]
            out.append(judge(claim, evidence))
    return out


# ----------------------------------------------------------------------------------------------- the tables
def number(value, kind) -> str:
    return f"{value:+.2f}" if kind == "quality" else f"{value:.2f}x"


def sets_cell(entry, kind, compact=False) -> str:
    """Per set: mean [90% interval]; compact writes a ratio's interval ends without their "x"."""
    parts = []
    for name, s in entry["sets"].items():
        if "figures" in s:
            low, high = min(s["figures"]), max(s["figures"])
            parts.append(f"{name} {low:.2f}x" if low == high else f"{name} {low:.2f}-{high:.2f}x")
        elif s["interval"] is None:
            parts.append(f"{name} {number(s['mean'], kind)}")
        else:
            low, high = (number(end, kind)[:-1] if compact and kind != "quality" else number(end, kind)
                         for end in s["interval"])
            parts.append(f"{name} {number(s['mean'], kind)} [{low}, {high}]")
    return "; ".join(parts)


def is_paper(entry) -> bool:
    """A quality entry of rows trained with a paper's recipe (recipe "paper (NAME)")."""
    return entry["task"] != "speed" and entry["recipe"].startswith("paper (")


def steps_text(entry) -> str:
    """Our recipe: each step budget ("1500 / 3000 steps"); a paper's recipe: the steps reached, their range over the
    rows and seeds, and whether every row converged ("6750-8000 steps reached, converged")."""
    if not is_paper(entry):
        return f"{joined(entry['steps'])} steps"
    low, high = min(entry["steps"]), max(entry["steps"])
    reached = f"{low}" if low == high else f"{low}-{high}"
    return f"{reached} steps reached, {'converged' if entry['converged'] else 'not converged'}"


def task_prefix(entry) -> str:
    """ "nouns, " before the evidence of a row group trained on the nouns task; nothing for Multi30k (the default)."""
    return "nouns, " if entry["task"] == "nouns" else ""


def rows_cell(entry) -> str:
    if entry["task"] == "speed":
        rounds = f", {rounds_text(entry['rounds'])}" if entry.get("rounds") else ""
        return f"{entry['evidence']}; {entry['machine']}, {entry['precision']}{rounds}"
    return (f"{task_prefix(entry)}{entry['evidence']}; {entry['machine']}, {entry['precision']}, {steps_text(entry)}, "
            f"{seeds_text(entry['seeds'])}")


def verdict_cell(entry) -> str:
    if entry["converged"] is None:  # speed
        return entry["verdict"]
    if is_paper(entry):
        state = "converged" if entry["converged"] else "not converged"
        low, high = min(entry["steps"]), max(entry["steps"])
        return f"{entry['verdict']} (paper's recipe, {state} at {low if low == high else f'{low}-{high}'} steps)"
    return f"{entry['verdict']} ({joined(entry['steps'])} steps, not converged)"


def measure_text(entry) -> str:
    """The measure without its inits: "hard_cross - soft", "time soft / time hard_retrieval"."""
    return " - ".join(side.split("@")[0] for side in entry["measure"].split(" - "))


def paper_table(entries, paper) -> str:
    """docs/results.md: every evidence group of each claim of one paper, the claim's cell carrying its anchor
    (``claim-ID``, the README's link) and the headline group marked."""
    lines = ["| paper's claim (bound) | measure; rows: machine, precision, steps, seeds | ours: mean [90% interval] "
             "| verdict |", "| --- | --- | --- | --- |"]
    for claim in claims_of(paper):
        group = [e for e in entries if e["id"] == claim.id]
        top = headline(claim, group)
        for i, entry in enumerate(group):
            cell = f'<a id="{anchor(claim)}"></a>{entry["claim"]} (bound {entry["bound"]})' if i == 0 else ""
            mark = "**headline:** " if entry is top else ""
            lines.append(f"| {cell} | {mark}`{measure_text(entry)}`; {rows_cell(entry)} | "
                         f"{sets_cell(entry, kind_of(entry))} | {verdict_cell(entry)} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the headline
DEFAULT_INIT = ("default init", "each type's default init")  # evidence labels of today's default init
PAPER_SEEDS = 3  # seeds a group of converged paper-recipe rows needs to come first


def earned(entry) -> bool:
    """A quality verdict earned as the papers' claims are: rows of the paper's recipe, every one converged (its
    convergence records, a decoded row its source's), at least PAPER_SEEDS paired seeds."""
    return is_paper(entry) and entry["converged"] is True and len(entry["seeds"]) >= PAPER_SEEDS


def device_of(entry) -> str:
    """A speed entry's device: "GPU" for gpu_speed.py's files (they name the GPU in ``environment``), else "CPU"."""
    with open(os.path.join(RESULTS, entry["rows"][0]["file"])) as handle:
        payload = json.load(handle)
    return "GPU" if payload.get("environment", {}).get("gpu_name") else "CPU"


def headline_key(claim: Claim, entry) -> tuple:
    """The headline rule as a sort key (smallest first).

    quality: first a group of converged paper-recipe rows with three or more seeds (``earned``: a verdict is earned
    at convergence with the paper's recipe), then rows of the task the paper made the claim on (``Claim.task``), then
    the most seeds, then the longest training (a group's fewest steps), then today's default init;
    speed and cost: timed rounds before figures (figures give no verdict), then rounds on the paper's device (the GPU
    where the claim's paper timed one, ``Claim.device``, else a CPU), then the most rounds.
    Ties keep the order of the claim's evidence in CLAIMS."""
    if entry["task"] != "speed":
        return (not earned(entry), claim.task not in (None, entry["task"]), -len(entry["seeds"]),
                -min(entry["steps"]), not entry["evidence"].startswith(DEFAULT_INIT))
    rounds = entry.get("rounds") or []
    return (not rounds, device_of(entry) != (claim.device or "CPU"), -max(rounds, default=0))


def headline(claim: Claim, entries) -> dict:
    """The claim's headline evidence (the README's one row): the first of its entries by headline_key."""
    entries = list(entries)
    if not entries:
        raise ValueError(f"claim {claim.id}: no evidence entry to choose a headline from.")
    return sorted(entries, key=lambda entry: headline_key(claim, entry))[0]  # sorted is stable: CLAIMS order on ties


def claims_of(paper) -> list[Claim]:
    return [claim for claim in CLAIMS + [BASELINE] if claim.paper == paper]


def anchor(claim: Claim) -> str:
    return f"claim-{claim.id}"


def kind_of(entry) -> str:
    return "quality" if entry["task"] != "speed" else "speed"


def short_word(verdict: str) -> str:
    """A verdict in a word or three, for the README's list of the other groups: split, not told apart, not judged."""
    for head in ("split", "not told apart", "not judged"):
        if verdict.startswith(head):
            return head
    return verdict


def readme_word(verdict: str) -> str:
    """The verdict less its "(n seeds)" / "(n rounds)", which the headline evidence cell gives beside it."""
    return re.sub(r" \(\d+ (?:seed|round)s\)", "", verdict)


def short_rows(entry) -> str:
    """The headline's evidence in short form: label; machine precision, steps, seed count (or rounds)."""
    if entry["task"] == "speed":
        count = rounds_text(entry["rounds"]) if entry.get("rounds") else "one figure per setting"
        return f"{entry['evidence']}; {entry['machine']} {entry['precision']}, {count}"
    n = len(entry["seeds"])
    return (f"{task_prefix(entry)}{entry['evidence']}; {entry['machine']} {entry['precision']}, {steps_text(entry)}, "
            f"{n} seed{'s' if n != 1 else ''}")


def headline_table(entries, paper) -> str:
    """README: one row per claim of the paper: the claim with our measure and its bound, the headline evidence, its
    mean [90% interval] per set, the rule's word (the evidence cell gives its recipe, convergence and seeds), and a
    link to the other groups in docs/results.md."""
    lines = ["| paper's claim: our measure, bound | headline evidence | ours: mean [90% interval] | verdict (more groups) |",
             "| --- | --- | --- | --- |"]
    for claim in claims_of(paper):
        group = [e for e in entries if e["id"] == claim.id]
        top = headline(claim, group)
        others = [e for e in group if e is not top]
        more = "" if not others else f" ([{len(others)} more](docs/results.md#{anchor(claim)}))"
        lines.append(f"| {claim.claim}: `{measure_text(top)}` {top['bound']} | {short_rows(top)} | "
                     f"{sets_cell(top, kind_of(top), compact=True)} | {readme_word(top['verdict'])}{more} |")
    return "\n".join(lines)


def detail_table(entries) -> str:
    """docs/results.md: every verdict per set, with the per-seed differences (or figures) and the files it read."""
    lines = ["| claim | measure; rows | set | per seed (or round count, figures) | mean [90% interval] | word | files |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for entry in entries:
        kind = "quality" if entry["task"] != "speed" else "speed"
        files = sorted({row["file"].split("/")[0] + ("/" if "/" in row["file"] else "") for row in entry["rows"]})
        for name, s in entry["sets"].items():
            if "figures" in s:
                detail, mean = ", ".join(f"{v:.2f}x" for v in s["figures"]), ""
            elif "rounds" in s:
                detail, mean = rounds_text([s["rounds"]]), sets_cell(dict(sets={"": s}), kind).strip()
            else:
                detail = ", ".join(f"s{seed} {d:+.2f}" for seed, d in zip(s["seeds"], s["differences"]))
                mean = sets_cell(dict(sets={"": s}), kind).strip()
            lines.append(f"| {entry['paper']} {entry['id'].split('-', 1)[1]} | `{measure_text(entry)}`; "
                         f"{rows_cell(entry)} | {name} | {detail} | {mean} | {s['word']} | "
                         f"{', '.join(f'`{f}`' for f in files)} |")
    return "\n".join(lines)


def status_line(entries) -> str:
    """README: how many of the README's quality verdicts (each quality claim's headline) rest on converged
    paper-recipe rows of three or more seeds (``earned``), and what the others rest on."""
    tops = [headline(claim, group) for claim in CLAIMS if claim.kind == "quality"
            for group in [[e for e in entries if e["id"] == claim.id]] if group]
    m = len(tops)
    n = sum(earned(top) for top in tops)
    paper = sum(is_paper(top) and not earned(top) for top in tops)
    ours = m - n - paper
    head = ("**No quality verdict yet rests on rows trained to convergence with the paper's recipe**" if not n else
            f"**{n} of the {m} quality verdicts rest on converged paper-recipe rows** ({PAPER_SEEDS}+ seeds, all "
            "converged; they head their claims)")
    rest = []
    if ours:
        rest.append(("all are" if ours == m else f"{ours} of the {m} {'is' if ours == 1 else 'are'}") +
                    " of our recipe (our init, fixed budgets, last checkpoint): a \"no\" there is about the "
                    "budget, not yet the mechanism")
    if paper:
        rest.append(f"{paper} of the {m} rest{'s' if paper == 1 else ''} on paper-recipe rows not all converged or "
                    f"of fewer than {PAPER_SEEDS} seeds")
    return head + (": " + "; ".join(rest) + "." if rest else ".")


def regions(entries) -> dict:
    """{(file, region name): generated text}."""
    out = {(DOCS_RESULTS, "verdicts"): detail_table(entries), (DOCS_RESULTS, "groups"): "\n\n".join(
        f"**{title}**\n\n{paper_table(entries, paper)}" for paper, title in
        [*TABLES.items(), ("baseline", "Baseline: our soft against MarianMTModel of the same size")])}
    for paper in TABLES:
        out[(README, f"paper {paper}")] = headline_table(entries, paper)
    out[(README, "status")] = status_line(entries)
    baseline = [e for e in entries if e["paper"] == "baseline"][0]
    out[(README, "baseline")] = (
        f"Baseline, {baseline['claim']}: `{measure_text(baseline)}` {baseline['bound']} ({short_rows(baseline)}): "
        f"{sets_cell(baseline, 'quality')}: **{baseline['verdict']}**.")
    return out


def replace_region(text: str, name: str, body: str, path: str) -> str:
    start, end = f"<!-- tables.py: {name} -->", "<!-- /tables.py -->"
    if text.count(start) != 1:
        raise ValueError(f"{path}: {text.count(start)} markers {start!r}; exactly one is needed.")
    head, rest = text.split(start, 1)
    if end not in rest:
        raise ValueError(f"{path}: {start!r} has no closing {end!r}.")
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def outputs() -> dict:
    """{path: the text this script writes there}."""
    entries = verdicts()
    texts = {VERDICTS: json.dumps(dict(
        rule=f"paired mean difference (quality) or geometric mean ratio over interleaved rounds (speed), "
             f"{LEVEL:.0%} two-sided t interval; holds: inside the paper's bound; no: wholly outside; "
             f"otherwise not told apart; one seed or one figure: no verdict",
        command="python benchmarks/tables.py", verdicts=entries), indent=1) + "\n"}
    for (path, name), body in regions(entries).items():
        if path not in texts:
            with open(path) as handle:
                texts[path] = handle.read()
        texts[path] = replace_region(texts[path], name, body, path)
    return texts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff where a committed file differs from what it would write")
    args = parser.parse_args(argv)
    differ = changed_verdicts = False
    for path, text in outputs().items():
        committed = open(path).read() if os.path.exists(path) else ""
        if committed == text:
            continue
        changed_verdicts |= path == VERDICTS
        if args.check:
            differ = True
            sys.stdout.writelines(difflib.unified_diff(committed.splitlines(True), text.splitlines(True),
                                                       f"{os.path.relpath(path, ROOT)} (committed)",
                                                       f"{os.path.relpath(path, ROOT)} (tables.py)"))
        else:
            with open(path, "w") as handle:
                handle.write(text)
            print(f"wrote {os.path.relpath(path, ROOT)}")
    if not args.check and changed_verdicts:  # the cards' "against the paper" verdicts are read from verdicts.json
        import importlib.util
        spec = importlib.util.spec_from_file_location("model_cards_build", os.path.join(ROOT, "model_cards", "build.py"))
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        for path in build.write_cards(build.FOLDER):
            print(f"wrote {os.path.relpath(path, ROOT)}")
    if differ:
        print("\nbenchmarks/tables.py --check: the files above differ from what `python benchmarks/tables.py` writes.")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
