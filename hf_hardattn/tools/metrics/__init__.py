"""The package's BLEU and chrF as an ``evaluate`` metric, loaded from the package itself (no Hub, works offline).

    import hf_hardattn.tools.metrics
    metric = hf_hardattn.tools.metrics.load()          # or evaluate.load(hf_hardattn.tools.metrics.METRIC_PATH)
    metric.compute(predictions=hypotheses, references=[[r] for r in references])
    # {'bleu': ..., 'bleu_signature': 'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...', 'chrf': ..., ...}

A drop-in for ``evaluate.load("sacrebleu")`` / ``evaluate.load("chrf")`` in a Trainer's ``compute_metrics`` (see
:func:`hf_hardattn.tools.training.translation_metrics`); the scores are sacrebleu's, computed by
:func:`hf_hardattn_cli.scores.corpus_scores`.
"""

from __future__ import annotations

import os

import evaluate

METRIC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bleu_chrf.py")  # the evaluate module script


def load(**kwargs) -> evaluate.EvaluationModule:
    """``evaluate.load(METRIC_PATH, **kwargs)``: the ``bleu_chrf`` metric, from the package's own file (nothing is
    downloaded). Results are kept in memory unless ``keep_in_memory=False`` is given (then evaluate's cache folder
    holds them, as for distributed evaluation with ``num_process``)."""
    kwargs.setdefault("keep_in_memory", kwargs.get("num_process", 1) == 1)
    return evaluate.load(METRIC_PATH, **kwargs)


__all__ = ["METRIC_PATH", "load"]
