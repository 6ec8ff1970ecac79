"""The package's BLEU and chrF as an ``evaluate`` metric (hf_hardattn/tools/metrics/bleu_chrf.py): it loads in a
fresh process with the network off and no Hub cache (by path and through ``hf_hardattn.tools.metrics.load``), and its
scores and signatures are sacrebleu's own (``corpus_bleu`` / ``corpus_chrf`` and the metric objects' signatures,
computed here); ``translation_metrics``, train_seq2seq's ``compute_metrics``, reports sacrebleu's scores of the
trained model's own ``generate()`` outputs; ``hf-hardattn score`` gives the metric's numbers."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import sacrebleu
import torch
from transformers import DataCollatorForSeq2Seq

from common import EOS, copy_task, tiny_kwargs, toy_tokenizer
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.tools.metrics import METRIC_PATH
from hf_hardattn.tools.training import train_seq2seq, translation_metrics
from hf_hardattn_cli.command import main as cli_main

HYPOTHESES = ["The cat sat on the mat today.", "", "A dog runs in the green park, quickly.",
              "Two men are playing chess outside", "the weather is FINE and the sun shines"]
REFERENCES = [  # two references per hypothesis (evaluate's layout: the references of each prediction)
    ["The cat sat on the mat.", "A cat was sitting on the mat today."],
    ["Nothing was said.", "Silence."],
    ["A dog is running in a green park.", "The dog runs quickly in the park."],
    ["Two men play chess outdoors.", "Two men are playing chess outside."],
    ["The weather is fine and the sun is shining.", "It is fine weather; the sun shines."],
]
CASES = [  # (compute keywords beyond predictions / references, sacrebleu BLEU keywords, sacrebleu chrF keywords)
    ({}, {}, {}),
    ({"tokenize": "intl", "lowercase": True}, {"tokenize": "intl", "lowercase": True}, {"lowercase": True}),
    ({"tokenize": "char"}, {"tokenize": "char"}, {}),
    ({"smooth_method": "floor", "smooth_value": 0.2, "word_order": 2, "beta": 3},
     {"smooth_method": "floor", "smooth_value": 0.2}, {"word_order": 2, "beta": 3}),
]

CHILD = textwrap.dedent("""
    import json, socket, sys

    def refuse(*args, **kwargs):
        raise OSError("the network is off in this test")

    socket.socket.connect = refuse  # any download attempt fails loudly
    socket.create_connection = refuse

    import evaluate
    import hf_hardattn.tools.metrics as metrics

    inputs = json.loads(sys.stdin.read())
    by_path = evaluate.load(metrics.METRIC_PATH, keep_in_memory=True)
    by_name = metrics.load()
    results = {}
    for label, metric in (("path", by_path), ("name", by_name)):
        results[label] = [metric.compute(predictions=inputs["hypotheses"], references=refs, **options)
                          for refs in (inputs["references"], inputs["one_reference"]) for options in inputs["cases"]]
    print(json.dumps(dict(results=results, names=[by_path.name, by_name.name])))
""")


def sacrebleu_scores(hypotheses, references, bleu_options, chrf_options):
    """sacrebleu's own scores and signatures; ``references`` in evaluate's layout, turned into sacrebleu's streams."""
    streams = [list(stream) for stream in zip(*references)]
    bleu, chrf = sacrebleu.BLEU(**bleu_options), sacrebleu.CHRF(**chrf_options)
    bleu_score, chrf_score = bleu.corpus_score(hypotheses, streams), chrf.corpus_score(hypotheses, streams)
    assert bleu_score.score == sacrebleu.corpus_bleu(hypotheses, streams, **bleu_options).score
    if "lowercase" not in chrf_options:  # (corpus_chrf has no lowercase option)
        assert chrf_score.score == sacrebleu.corpus_chrf(hypotheses, streams, **chrf_options).score
    return {"bleu": bleu_score.score, "bleu_signature": str(bleu.get_signature()),
            "chrf": chrf_score.score, "chrf_signature": str(chrf.get_signature())}


@pytest.fixture(scope="module")
def offline_child(tmp_path_factory):
    """The metric loaded and computed in a fresh process: HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, HF_EVALUATE_OFFLINE,
    sockets refused, an empty HF_HOME (no cached Hub metric to fall back on)."""
    home = tmp_path_factory.mktemp("hf_home")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1", HF_HOME=str(home),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for name in ("HF_MODULES_CACHE", "HF_EVALUATE_CACHE", "HF_METRICS_CACHE"):
        env.pop(name, None)
    inputs = dict(hypotheses=HYPOTHESES, references=REFERENCES, one_reference=[refs[0] for refs in REFERENCES],
                  cases=[options for options, _, _ in CASES])
    process = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(inputs), capture_output=True, text=True,
                             env=env, timeout=600, cwd=home)
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_metric_loads_offline_by_path_and_by_name_and_equals_sacrebleu(offline_child):
    assert offline_child["names"] == ["bleu_chrf", "bleu_chrf"]
    expected = [sacrebleu_scores(HYPOTHESES, refs, bleu, chrf)
                for refs in (REFERENCES, [[r[0]] for r in REFERENCES]) for _, bleu, chrf in CASES]
    assert [e["bleu_signature"].split("|")[0] for e in expected] == ["nrefs:2"] * 4 + ["nrefs:1"] * 4
    for label in ("path", "name"):
        assert offline_child["results"][label] == expected, label
    # the cases differ from each other (each option changes a score), and no score is 0 or 100 (too little to compare)
    assert len({(e["bleu"], e["chrf"]) for e in expected}) == len(expected)
    assert all(0 < e[name] < 100 for e in expected for name in ("bleu", "chrf")), expected


def test_metric_refuses_uneven_references_and_unknown_options():
    from hf_hardattn.tools.metrics import load

    metric = load()
    with pytest.raises(ValueError, match=r"same number of references for every prediction"):
        metric.compute(predictions=["a b", "c d"], references=[["a b"], ["c d", "c e"]])
    with pytest.raises(ValueError, match=r"`tokenize` must be one of .*'13a'.*got 'moses'"):
        metric.compute(predictions=["a b"], references=[["a b"]], tokenize="moses")
    with pytest.raises(ValueError, match=r"`smooth_method` must be one of .*got 'log'"):
        metric.compute(predictions=["a b"], references=[["a b"]], smooth_method="log")
    assert os.path.basename(METRIC_PATH) == "bleu_chrf.py" and os.path.isfile(METRIC_PATH)


def test_train_seq2seq_compute_metrics_reports_sacrebleu_of_the_models_outputs(tmp_path):
    """train_seq2seq(..., compute_metrics=translation_metrics(tokenizer), predict_with_generate=True): the Trainer's
    eval_bleu / eval_chrf are sacrebleu's scores of the trained model's own generate() outputs on the same batch,
    decoded here (the toy tokenizer: word-level, token i is 't{i}')."""
    torch.manual_seed(0)
    tokenizer = toy_tokenizer()
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs()))
    train, test = copy_task(512, seed=0), copy_task(16, seed=1)
    trainer = train_seq2seq(model, tokenizer, train, eval_ds=test, output_dir=tmp_path / "run", max_steps=60,
                            batch_size=16, learning_rate=5e-3, warmup_steps=5, lr_scheduler="constant_with_warmup",
                            group_by_length=False, progress=False, compute_metrics=translation_metrics(tokenizer),
                            predict_with_generate=True, generation_max_length=12, per_device_eval_batch_size=16)
    reported = trainer.evaluate()
    batch = DataCollatorForSeq2Seq(tokenizer, model=model)(test)
    with torch.no_grad():
        generated = model.eval().generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                          max_length=12)
    hypotheses = [" ".join(f"t{t}" for t in row if t > EOS) for row in generated.tolist()]
    references = [" ".join(f"t{t}" for t in row["labels"] if t > EOS) for row in test]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    chrf = sacrebleu.corpus_chrf(hypotheses, [references]).score
    assert 0 < bleu < 100 and 0 < chrf < 100, (bleu, chrf, hypotheses)
    assert reported["eval_bleu"] == pytest.approx(bleu, rel=1e-12, abs=1e-12)
    assert reported["eval_chrf"] == pytest.approx(chrf, rel=1e-12, abs=1e-12)


def test_score_command_gives_the_metrics_numbers(tmp_path, capsys):
    """``hf-hardattn score --json`` with two reference files: the evaluate metric's scores (rounded to 4 places as
    the command prints them) and the same signatures."""
    from hf_hardattn.tools.metrics import load

    hyp = tmp_path / "hyp.txt"
    hyp.write_text("".join(h + "\n" for h in HYPOTHESES))
    files = []
    for k in range(2):
        files.append(tmp_path / f"ref{k}.txt")
        files[-1].write_text("".join(refs[k] + "\n" for refs in REFERENCES))
    cli_main(["score", str(hyp), *map(str, files), "--json", "--tokenize", "intl"])
    printed = json.loads(capsys.readouterr().out)
    expected = load().compute(predictions=HYPOTHESES, references=REFERENCES, tokenize="intl")
    assert [(r["score"], r["signature"]) for r in printed] == [
        (round(expected["bleu"], 4), expected["bleu_signature"]), (round(expected["chrf"], 4), expected["chrf_signature"])]
