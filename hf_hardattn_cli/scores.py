"""Corpus BLEU and chrF with sacrebleu's signatures: the package's one scoring function.

``hf-hardattn score``, :func:`hf_hardattn.tools.training.bleu`, the Trainer's ``compute_metrics``
(:func:`hf_hardattn.tools.training.translation_metrics`) and the ``evaluate`` metric
(:mod:`hf_hardattn.tools.metrics`) all call :func:`corpus_scores`, so a score means the same thing wherever it is
reported. It lives in the command's front (``hf_hardattn_cli``, outside the package) and imports sacrebleu only, so
``score`` starts without torch and transformers; the package's tooling imports it from here.
"""

from __future__ import annotations

import sacrebleu

METRICS = ("bleu", "chrf")
TOKENIZERS = tuple(sacrebleu.BLEU.TOKENIZERS)  # sacrebleu's BLEU tokenisations (none, zh, 13a, intl, char, ...)
SMOOTH_METHODS = tuple(sacrebleu.BLEU.SMOOTH_DEFAULTS)  # none, floor, add-k, exp


def corpus_scores(hypotheses, references, metrics=METRICS, tokenize: str = "13a", lowercase: bool = False,
                  smooth_method: str = "exp", smooth_value: float | None = None, use_effective_order: bool = False,
                  char_order: int = 6, word_order: int = 0, beta: int = 2) -> dict:
    """sacrebleu's corpus BLEU and chrF of ``hypotheses`` (strings) against ``references``: sacrebleu's layout, a
    list of reference streams, each one string per hypothesis (``[refs]`` for one reference each).

    Returns ``{name: (score, signature)}`` for each name in ``metrics``: sacrebleu's score object (``.score``,
    ``.format()``) and its signature string (what to report beside the number). BLEU takes ``tokenize``,
    ``smooth_method``, ``smooth_value`` and ``use_effective_order``; chrF ``char_order``, ``word_order`` (2: chrF++)
    and ``beta``; both ``lowercase``. The defaults are sacrebleu's."""
    hypotheses = list(hypotheses)
    references = [list(stream) for stream in references]
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    unknown = [name for name in metrics if name not in METRICS]
    if not metrics or unknown:
        raise ValueError(f"`metrics` must name some of {METRICS}, got {metrics!r}.")
    if tokenize not in TOKENIZERS:
        raise ValueError(f"`tokenize` must be one of {TOKENIZERS}, got {tokenize!r}.")
    if smooth_method not in SMOOTH_METHODS:
        raise ValueError(f"`smooth_method` must be one of {SMOOTH_METHODS}, got {smooth_method!r}.")
    if not hypotheses:
        raise ValueError("`hypotheses` is empty; a corpus score needs at least one hypothesis.")
    if not references:
        raise ValueError("`references` is empty; give at least one reference stream (one string per hypothesis).")
    for k, stream in enumerate(references):
        if len(stream) != len(hypotheses):
            raise ValueError(f"`references` stream {k} has {len(stream)} strings for {len(hypotheses)} hypotheses; "
                             "each stream needs one reference per hypothesis.")
    scorers = dict(
        bleu=lambda: sacrebleu.BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method,
                                    smooth_value=smooth_value, effective_order=use_effective_order),
        chrf=lambda: sacrebleu.CHRF(char_order=char_order, word_order=word_order, beta=beta, lowercase=lowercase))
    results = {}
    for name in metrics:
        scorer = scorers[name]()
        score = scorer.corpus_score(hypotheses, references)
        results[name] = (score, str(scorer.get_signature()))
    return results


__all__ = ["corpus_scores", "METRICS", "TOKENIZERS", "SMOOTH_METHODS"]
