"""A trained model has one decoding setting: ``hf-hardattn train`` and ``train_seq2seq`` save the beam and length
their evaluations used in the model's generation config (every model type, with and without ``--eval-steps``, with
``--resume``), and every score of the run (the Trainer's evaluation of the best checkpoint, results.json, the card's
model-index, ``translate`` of the saved model) is measured with it and names it."""

import json
import os
import random

import pytest
import sacrebleu
import yaml
from datasets import Dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.registry import MODEL_TYPES
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import tokenize_dataset, train_seq2seq, translate
from hf_hardattn_cli.command import main

from test_train_cli import SIZES, write_pairs

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A word-reversal task as en/de files (train 64, valid 12) and a small byte-level BPE tokenizer ("Ġa" is one
    token: a model that repeats it writes "a a a ...")."""
    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "a b c d e f".split()

    def pair():
        source = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
        return source, " ".join(reversed(source.split()))

    pairs = [pair() for _ in range(76)]
    write_pairs(folder / "train", pairs[:64])
    write_pairs(folder / "valid", pairs[64:])
    tokenizer = train_tokenizer([p for pair in pairs for p in pair], vocab_size=300, min_frequency=1)
    tokenizer.save_pretrained(folder / "tok")
    return folder


def train(data, out, model_type, *extra):
    argv = ["train", "--train", str(data / "train"), "--source-lang", "en", "--target-lang", "de", "--model-type",
            model_type, "--output-dir", str(out), "--quiet", "--threads", "1", "--warmup-steps", "2",
            "--batch-size", "16", "--max-length", "16"]
    if "--init-from" not in extra:
        argv += ["--tokenizer", str(data / "tok"), *SIZES]
    return main(argv + list(extra))


def saved_generation(folder):
    return GenerationConfig.from_pretrained(folder)


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_train_with_evaluations_saves_the_runs_beam_and_length(data, tmp_path, model_type):
    """With --eval-steps the Trainer evaluates with generate(); transformers' Seq2SeqTrainer writes every unset
    generation field into the model (num_beams 1), which the checkpoints and the final model saved: greedy decoding
    where the run scored beam 3."""
    out = tmp_path / "run"
    assert train(data, out, model_type, "--max-steps", "4", "--eval-steps", "2", "--validation", str(data / "valid"),
                 "--num-beams", "3") == 0
    for folder in (out / "model", out / "trainer" / "checkpoint-2", out / "trainer" / "checkpoint-4"):
        generation = saved_generation(folder)
        assert (generation.num_beams, generation.max_new_tokens) == (3, 16), folder
    model = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    assert (model.generation_config.num_beams, model.generation_config.max_new_tokens) == (3, 16)
    assert json.loads((out / "results.json").read_text())["decoding"] == "beam 3, at most 16 new tokens"


def test_train_without_evaluations_and_resumed_saves_the_runs_setting(data, tmp_path):
    out = tmp_path / "run"
    assert train(data, out, "soft_transformer", "--max-steps", "4", "--save-steps", "2", "--num-beams", "2") == 0
    assert (saved_generation(out / "model").num_beams, saved_generation(out / "model").max_new_tokens) == (2, 16)
    assert train(data, out, "soft_transformer", "--max-steps", "6", "--save-steps", "2", "--num-beams", "2",
                 "--resume") == 0
    assert (saved_generation(out / "model").num_beams, saved_generation(out / "model").max_new_tokens) == (2, 16)
    # a fine-tuned model takes the new run's setting, not the one it was saved with
    again = tmp_path / "again"
    assert train(data, again, "soft_transformer", "--init-from", str(out / "model"), "--max-steps", "2",
                 "--eval-steps", "2", "--validation", str(data / "valid"), "--num-beams", "1") == 0
    assert (saved_generation(again / "model").num_beams, saved_generation(again / "model").max_new_tokens) == (1, 16)


def test_train_seq2seq_saves_the_setting_its_evaluations_used(data, tmp_path):
    """In Python: generation_num_beams / generation_max_length go into the model's generation config (checkpoints and
    the returned model), and fields the caller left unset stay unset (not transformers' defaults)."""
    tokenizer = AutoTokenizer.from_pretrained(data / "tok")
    pairs = {"source": (data / "train.en").read_text().splitlines(),
             "target": (data / "train.de").read_text().splitlines()}
    dataset = tokenize_dataset(Dataset.from_dict(pairs), tokenizer, max_length=16)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(
        vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id))
    assert model.generation_config.num_beams is None and model.generation_config.top_k is None
    trainer = train_seq2seq(model, tokenizer, dataset, dataset.select(range(8)), output_dir=str(tmp_path / "t"),
                            max_steps=2, eval_steps=1, save_steps=2, batch_size=16, warmup_steps=1, progress=False,
                            predict_with_generate=True, generation_num_beams=3, generation_max_length=20)
    for generation in (trainer.model.generation_config, saved_generation(tmp_path / "t" / "checkpoint-2")):
        assert (generation.num_beams, generation.max_length, generation.max_new_tokens) == (3, 20, None)
        assert generation.top_k is None  # the Trainer's fill-in of its defaults does not stay


def test_one_bleu_per_checkpoint(data, tmp_path):
    """A model that never ends its output (a large fixed logit on "Ġa"): its BLEU depends on where the length rule
    cuts it. The Trainer's evaluation of the best checkpoint, results.json (best and final), the card's model-index
    and translate() of the saved model give the same BLEU, measured with the saved setting. (Before: the Trainer cut
    at --max-length tokens in all, translate at 1.5 x the source + 10, and results.json gave two BLEUs.)"""
    tokenizer = AutoTokenizer.from_pretrained(data / "tok")
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(
        vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, final_logits_bias=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, decoder_start_token_id=tokenizer.bos_token_id))
    model.final_logits_bias[0, tokenizer.convert_tokens_to_ids("Ġa")] = 50.0
    model.save_pretrained(tmp_path / "start", tokenizer=tokenizer)
    out = tmp_path / "run"
    assert train(data, out, "soft_transformer", "--init-from", str(tmp_path / "start"), "--max-steps", "2",
                 "--eval-steps", "1", "--validation", str(data / "valid"), "--num-beams", "2",
                 "--learning-rate", "1e-12") == 0
    results = json.loads((out / "results.json").read_text())
    state = json.loads((out / "trainer" / "checkpoint-2" / "trainer_state.json").read_text())
    trainer_bleu = {entry["step"]: entry["eval_bleu"] for entry in state["log_history"] if "eval_bleu" in entry}
    best = int(results["best_checkpoint"].rsplit("-", 1)[-1])
    assert trainer_bleu[best] > 0
    assert round(trainer_bleu[best], 2) == results["validation_bleu"]  # the Trainer's and the final model's
    assert results["best_validation_bleu"] == results["validation_bleu"]
    card = (out / "model" / "README.md").read_text()
    index = yaml.safe_load(card.split("---")[1])["model-index"][0]["results"]
    card_bleu = [m for r in index for m in r["metrics"] if m["type"] == "bleu" and "validation" in m["name"]]
    assert [m["value"] for m in card_bleu] == [results["validation_bleu"]]
    assert "beam 2, at most 16 new tokens" in card_bleu[0]["name"]
    assert results["bleu_signature"].endswith("(beam 2, at most 16 new tokens)")
    # the saved model decodes with that setting by default: translate() and the hypotheses file agree with the score
    saved = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    sources = (data / "valid.en").read_text().splitlines()
    references = (data / "valid.de").read_text().splitlines()
    hypotheses = translate(saved, AutoTokenizer.from_pretrained(out / "model"), sources, num_beams=2)
    assert hypotheses == (out / "validation.hyp").read_text().splitlines()
    assert all(len(h.split()) == 16 for h in hypotheses)  # cut by the saved max_new_tokens, nowhere else
    assert round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2) == results["validation_bleu"]
