"""Corpus BLEU and chrF (sacrebleu, with their signatures) as an ``evaluate`` metric that loads without the Hub.

Shipped with the package and loaded by path, offline: ``evaluate.load(hf_hardattn.tools.metrics.METRIC_PATH)`` or
``hf_hardattn.tools.metrics.load()``. The numbers are :func:`hf_hardattn_cli.scores.corpus_scores`', the same
function ``hf-hardattn score`` and the training helpers call.
"""

import datasets
import evaluate

from hf_hardattn_cli.scores import corpus_scores

_DESCRIPTION = """Corpus BLEU (Papineni et al. 2002) and chrF (Popovic 2015) as computed by sacrebleu (Post 2018) on
detokenised text, each with sacrebleu's signature, the string to report beside the score."""

_CITATION = """@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    pages = "186--191",
}"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings (detokenised).
    references: one list of reference strings per prediction, the same number for every prediction (or one
        reference string per prediction).
    tokenize: BLEU tokenisation, sacrebleu's (default "13a"; "intl", "zh", "char", "none", ...).
    lowercase: case-insensitive BLEU and chrF (default False).
    smooth_method, smooth_value, use_effective_order: BLEU's, as sacrebleu (default "exp", None, False).
    char_order, word_order, beta: chrF's, as sacrebleu (default 6, 0, 2; word_order=2 is chrF++).
Returns:
    bleu, chrf: the corpus scores (0-100), exactly sacrebleu.corpus_bleu / corpus_chrf;
    bleu_signature, chrf_signature: sacrebleu's signatures of the two scores.
Example:
    >>> metric = hf_hardattn.tools.metrics.load()
    >>> metric.compute(predictions=["the cat sat on the mat"], references=[["the cat sat on the mat"]])["bleu"]
    100.00000000000004
"""

FEATURES = [
    datasets.Features({"predictions": datasets.Value("string", id="sequence"),
                       "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references")}),
    datasets.Features({"predictions": datasets.Value("string", id="sequence"),
                       "references": datasets.Value("string", id="sequence")}),
]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BleuChrf(evaluate.Metric):
    """sacrebleu's corpus BLEU and chrF with their signatures (module name ``bleu_chrf``)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION, features=FEATURES,
            homepage="https://github.com/mjpost/sacrebleu", codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://aclanthology.org/W18-6319/", "https://aclanthology.org/W15-3049/"])

    def _compute(self, predictions, references, tokenize="13a", lowercase=False, smooth_method="exp",
                 smooth_value=None, use_effective_order=False, char_order=6, word_order=0, beta=2):
        references = [[refs] if isinstance(refs, str) else list(refs) for refs in references]
        counts = {len(refs) for refs in references}
        if len(counts) > 1:
            raise ValueError(f"`references` gives {sorted(counts)} references per prediction; sacrebleu needs the "
                             "same number of references for every prediction.")
        # evaluate's layout (the references of each prediction) -> sacrebleu's (one stream per reference)
        streams = [[refs[k] for refs in references] for k in range(counts.pop() if counts else 0)]
        scores = corpus_scores(predictions, streams, tokenize=tokenize, lowercase=lowercase,
                               smooth_method=smooth_method, smooth_value=smooth_value,
                               use_effective_order=use_effective_order, char_order=char_order,
                               word_order=word_order, beta=beta)
        return {"bleu": scores["bleu"][0].score, "bleu_signature": scores["bleu"][1],
                "chrf": scores["chrf"][0].score, "chrf_signature": scores["chrf"][1]}
