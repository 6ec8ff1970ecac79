"""Shared tooling: data loaders, tokenizers, training / evaluation helpers and the ``demo`` command.

Runs without the shared data folder (temporary files only) and offline.
"""

import gzip
import json
import math
import os
import platform
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

from common import TYPE_MODELS, TYPE_NAMES, tiny_kwargs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from hf_hardattn import SoftTransformerConfig, SoftTransformerForConditionalGeneration  # noqa: E402
from hf_hardattn.tools.data import _noun_paradigms, default_multi30k_root, german_nouns, load_parallel, multi30k  # noqa: E402
from hf_hardattn.model_card import MIN_TRANSFORMERS  # noqa: E402
from hf_hardattn.tools.tokenization import train_tokenizer  # noqa: E402
from hf_hardattn.tools.training import (  # noqa: E402
    accuracy, bleu, decode_speed, tokenize_dataset, train_seq2seq, translate)

EN = ["A man rides a bike.", "Two dogs play in the snow.", "A woman is reading a book."]
DE = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
CORPUS = EN + DE + ["Die Häuser sind groß.", "Der Junge läuft über die Straße."] * 3


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_model_cards_name_the_pyproject_transformers_bound():
    """The cards' required transformers is the one pip enforces and .ci/run tests against."""
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as handle:
        pyproject = handle.read()
    assert f'"transformers>={MIN_TRANSFORMERS}",' in pyproject


def write(path, lines, compress):
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
def test_load_parallel_gz_and_plain(tmp_path):
    write(tmp_path / "train.en.gz", EN, True)
    write(tmp_path / "train.de.gz", DE, True)
    write(tmp_path / "val.en", EN[:2], False)
    write(tmp_path / "val.de", DE[:2], False)
    ds = load_parallel(tmp_path, "train")
    assert ds.column_names == ["source", "target"]
    assert ds["source"] == EN and ds["target"] == DE
    reverse = load_parallel(tmp_path, "val", src="de", tgt="en")
    assert reverse["source"] == DE[:2] and reverse["target"] == EN[:2]
    with pytest.raises(FileNotFoundError, match=r"test\.de\[\.gz\]"):
        write(tmp_path / "test.en", EN, False)
        load_parallel(tmp_path, "test")
    write(tmp_path / "bad.en", EN, False)
    write(tmp_path / "bad.de", DE[:2], False)
    with pytest.raises(ValueError, match="sentence-aligned"):
        load_parallel(tmp_path, "bad")


def test_multi30k_root_and_env(tmp_path, monkeypatch):
    write(tmp_path / "val.en.gz", EN, True)
    write(tmp_path / "val.de.gz", DE, True)
    assert multi30k("val", root=tmp_path)["target"] == DE
    monkeypatch.setenv("HF_HARDATTN_MULTI30K", str(tmp_path))
    assert multi30k("val")["source"] == EN
    with pytest.raises(FileNotFoundError, match="root=FOLDER"):
        multi30k("val", root=tmp_path / "absent")


def test_multi30k_default_root_is_shared_beside_the_checkout(monkeypatch):
    """Without $HF_HARDATTN_MULTI30K the data is read from ../shared/data/multi30k beside the repository root (the
    project's layout); the default pointed inside the checkout after the tooling moved to hf_hardattn/tools/."""
    monkeypatch.delenv("HF_HARDATTN_MULTI30K", raising=False)
    checkout = Path(__file__).resolve().parent.parent  # tests/ is at the repository root
    assert Path(default_multi30k_root()) == checkout.parent / "shared" / "data" / "multi30k"


def test_noun_paradigm_by_hand():
    """Haus (neuter): Haus, Häuser, Hauses, Häuser, Haus, Häusern, Haus, Häuser (German grammar, by hand)."""
    paradigms = {lemma: (gender, cells) for lemma, gender, cells in _noun_paradigms(True)}
    gender, cells = paradigms["Haus"]
    assert gender == "n"
    assert [form for _, _, form in cells] == ["Haus", "Häuser", "Hauses", "Häuser", "Haus", "Häusern", "Haus", "Häuser"]
    assert "-chen" not in paradigms and "Berlin" not in paradigms  # affixes and toponyms are left out


def test_german_nouns_split_by_lemma_and_deterministic():
    first = german_nouns(seed=0, max_examples=3000)
    again = german_nouns(seed=0, max_examples=3000)
    other = german_nouns(seed=1, max_examples=3000)
    assert sum(len(first[s]) for s in first) == 3000
    lemmas = {split: set(first[split]["lemma"]) for split in first}
    assert not lemmas["train"] & lemmas["test"]
    assert not lemmas["train"] & lemmas["validation"]
    assert not lemmas["validation"] & lemmas["test"]
    assert len(first["test"]) > 0 and len(first["validation"]) > 0
    for split in first:
        assert first[split].to_dict() == again[split].to_dict()
    assert first["test"]["lemma"] != other["test"]["lemma"]
    for row in first["train"].select(range(50)):
        gender = f"<{row['gender']}> " if row["gender"] else ""
        assert row["source"] == f"{row['lemma']} {gender}{row['tag']}"
        assert row["target"] and " " not in row["target"]
    with pytest.raises(ValueError, match="test_fraction"):
        german_nouns(test_fraction=1.5)


# ---------------------------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------------------------
def test_bpe_tokenizer_round_trip_specials_save_load(tmp_path):
    write(tmp_path / "a.gz", CORPUS, True)
    write(tmp_path / "b.txt", DE, False)
    tok = train_tokenizer([str(tmp_path / "a.gz"), str(tmp_path / "b.txt")], vocab_size=300, kind="bpe")
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    for text in CORPUS + ["Völlig neue Wörter: Straßenbahn, ½ Ölfass!", "  two  spaces "]:
        ids = tok(text)["input_ids"]
        assert ids[-1] == 2 and ids.count(2) == 1
        assert 3 not in ids  # byte-level: nothing is unknown
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok(text_target="Ein Mann")["input_ids"][-1] == 2
    tok.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert reloaded("Zwei Hunde.")["input_ids"] == tok("Zwei Hunde.")["input_ids"]
    assert reloaded.pad_token_id == 0 and reloaded.eos_token_id == 2


def test_a_vocab_size_below_what_the_kind_needs_is_refused_naming_the_minimum(tmp_path, capsys):
    """Byte-level BPE keeps its 256 byte symbols whatever vocab_size: the tokenizers library's own trainer, given 100,
    returns 4 + 256 = 260 entries; so train_tokenizer refuses a size below 260 (instead of returning 260 entries
    silently), and the sizes from 260 up are honoured exactly. char: the specials and one character."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hf_hardattn.tools.tokenization import SPECIAL_TOKENS, min_vocab_size
    from hf_hardattn_cli.command import main

    texts = CORPUS * 5 + DE * 5
    raw = Tokenizer(models.BPE(unk_token="<unk>"))  # the reference: the library alone, as train_tokenizer sets it up
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100, special_tokens=list(SPECIAL_TOKENS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    assert min_vocab_size("bpe") == raw.get_vocab_size() == 260
    for size in (260, 261, 300):
        assert len(train_tokenizer(texts, vocab_size=size, min_frequency=1)) == size
    for size in (100, 259):
        with pytest.raises(ValueError, match=rf"`vocab_size` must be an integer >= 260 for kind='bpe' .*got {size}"):
            train_tokenizer(texts, vocab_size=size)
    assert min_vocab_size("char") == 5 and len(train_tokenizer(texts, vocab_size=5, kind="char")) == 5
    with pytest.raises(ValueError, match=r"`vocab_size` must be an integer >= 5 for kind='char' .*got 4"):
        train_tokenizer(texts, vocab_size=4, kind="char")
    write(tmp_path / "a.txt", CORPUS, False)
    assert main(["tokenizer", "--files", str(tmp_path / "a.txt"), "--vocab-size", "100", "--out",
                 str(tmp_path / "tok")]) == 2
    assert "--vocab-size=100 is below 260" in capsys.readouterr().err and not (tmp_path / "tok").exists()


def test_char_tokenizer_keeps_tags_whole(tmp_path):
    texts = ["Haus <n> <gen> <pl>", "Häuser", "Frau <f> <dat> <sg>", "Frauen"]
    tok = train_tokenizer(texts, kind="char", min_frequency=1)
    tokens = tok.convert_ids_to_tokens(tok("Haus <gen> <pl>")["input_ids"])
    assert tokens == ["H", "a", "u", "s", " ", "<gen>", " ", "<pl>", "</s>"]
    for text in texts:
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok("Hz")["input_ids"] == [tok.convert_tokens_to_ids("H"), 3, 2]  # unseen character -> <unk>
    tok.save_pretrained(tmp_path / "char")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "char")
    assert reloaded.decode(reloaded("Frau <f> <dat> <sg>")["input_ids"], skip_special_tokens=True) == texts[2]
    with pytest.raises(ValueError, match="kind"):
        train_tokenizer(texts, kind="word")


# ---------------------------------------------------------------------------------------------------------------
# training / evaluation
# ---------------------------------------------------------------------------------------------------------------
def reversal_dataset(n=256, seed=0):
    import random

    import datasets

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 7))) for _ in range(n)]
    return datasets.Dataset.from_dict({"source": words, "target": [w[::-1] for w in words]})


class StepClock(TrainerCallback):
    """``hf_hardattn.tools.training``'s clock (its ``time.perf_counter``) made to advance ``seconds`` at the start of every
    optimizer step, so that a time budget ends after a number of steps that does not depend on the CPU's speed. Pass
    it to train_seq2seq as a callback; it stops training itself after ``limit`` steps (a budget that never ends
    fails the test's step count instead of training forever)."""

    def __init__(self, seconds, limit=100):
        self.now, self.seconds, self.limit = 1000.0, seconds, limit

    def perf_counter(self):
        return self.now

    def on_step_begin(self, args, state, control, **kwargs):
        self.now += self.seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.limit:
            control.should_training_stop = True


def step_clock(monkeypatch, seconds):
    import hf_hardattn.tools.training

    clock = StepClock(seconds)
    monkeypatch.setattr(hf_hardattn.tools.training, "time", clock)
    return clock


def test_tokenize_and_train_seq2seq(tmp_path, monkeypatch):
    raw = reversal_dataset()
    tok = train_tokenizer(raw, kind="char", min_frequency=1)
    data = tokenize_dataset(raw, tok, max_length=16)
    assert data.column_names == ["input_ids", "attention_mask", "labels"]
    assert data[0]["labels"] == tok(text_target=raw[0]["target"])["input_ids"]
    assert data[0]["input_ids"][-1] == 2 and data[0]["labels"][-1] == 2
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(vocab_size=len(tok))))
    trainer = train_seq2seq(model, tok, data, output_dir=tmp_path / "run", max_steps=30, batch_size=16,
                            learning_rate=3e-3, warmup_steps=5, logging_steps=5, progress=False)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 30
    assert losses[-1] < 0.8 * losses[0], losses
    assert not model.training
    # a wall-clock budget stops training at the end of the first step that reaches it (steps of 0.25 s on the
    # clock: 0.6 s are reached at the end of step 3), long before its step limit
    with monkeypatch.context() as patch:
        budget = train_seq2seq(model, tok, data, output_dir=tmp_path / "run2", minutes=0.01, batch_size=16,
                               warmup_steps=5, progress=True, callbacks=[step_clock(patch, 0.25)])
    assert budget.state.global_step == 3 and budget.state.max_steps == 10**9
    # on the real clock: the run lasts at least its budget of 0.3 s (it stops only once the budget is spent)
    budget = train_seq2seq(model, tok, data, output_dir=tmp_path / "run3", minutes=0.005, batch_size=16,
                           warmup_steps=5, progress=False)
    runtime = next(log["train_runtime"] for log in budget.state.log_history if "train_runtime" in log)
    assert budget.state.global_step >= 1 and runtime >= 0.29, (budget.state.global_step, runtime)
    with pytest.raises(ValueError, match="lr_scheduler"):
        train_seq2seq(model, tok, data, output_dir=tmp_path / "x", lr_scheduler="linear")  # neither steps nor minutes
    with pytest.raises(ValueError, match="lr_scheduler"):
        train_seq2seq(model, tok, data, output_dir=tmp_path / "x", max_steps=3, lr_scheduler="warmup_stable")
    from transformers import Seq2SeqTrainer

    with pytest.raises(ValueError, match="`trainer_class` must be a subclass of Seq2SeqLengthTrainer"):
        train_seq2seq(model, tok, data, output_dir=tmp_path / "x", max_steps=3, trainer_class=Seq2SeqTrainer)


def test_time_decay_schedule_by_hand():
    """Warm-up by steps, then linear / cosine decay over the share of the time budget left after the warm-up."""
    from hf_hardattn.tools.training import TimeBudget, time_decay_schedule

    class Clock(TimeBudget):
        now = 0.0

        def elapsed(self):
            return self.now

    budget = Clock(minutes=1.0)  # 60 s
    linear, cosine = time_decay_schedule(budget, 10, "linear"), time_decay_schedule(budget, 10, "cosine")
    assert [linear(s) for s in (0, 5)] == [0.0, 0.5]
    budget.now = 20.0  # the warm-up ends at 1/3 of the budget
    assert linear(10) == 1.0 and cosine(10) == 1.0
    budget.now = 40.0  # half of the remaining 40 s
    assert linear(50) == pytest.approx(0.5) and cosine(50) == pytest.approx(0.5)
    budget.now = 30.0
    assert linear(30) == pytest.approx(0.75) and cosine(30) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    budget.now = 70.0  # the last step may overrun the budget
    assert linear(99) == 0.0 and cosine(99) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="linear' or 'cosine"):
        time_decay_schedule(budget, 10, "inverse_sqrt")


def test_bf16_time_decay_training_decays_to_zero(tmp_path, monkeypatch):
    """bf16 autocast training on CPU with a time-decayed linear schedule: on a clock of 0.28 s per step, the 9 s budget
    ends training at step 33 (the first to reach it) and every step's learning rate is the schedule by hand (warm-up
    over 5 steps, then linear from the time at the warm-up's end to 0 at the budget); the loss falls, the model's
    weights stay fp32, and the trained model decodes in fp32 again (accelerate's autocast wrapper of its forward is
    removed)."""
    import hf_hardattn.tools.training

    monkeypatch.setattr(hf_hardattn.tools.training, "cpu_has_bf16_matmul", lambda: True)  # tiny: fast enough on any CPU
    raw = reversal_dataset()
    tok = train_tokenizer(raw, kind="char", min_frequency=1)
    data = tokenize_dataset(raw, tok, max_length=16)
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(vocab_size=len(tok))))
    dtypes = set()
    model.lm_head.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    trainer = train_seq2seq(model, tok, data, output_dir=tmp_path / "run", minutes=0.15, batch_size=16,
                            learning_rate=3e-3, warmup_steps=5, logging_steps=1, progress=False,
                            lr_scheduler="linear", bf16=True, callbacks=[step_clock(monkeypatch, 0.28)])
    assert dtypes == {torch.bfloat16}  # the steps ran under autocast
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 33 and [log["step"] for log in logs] == list(range(1, 34))

    def by_hand(step):  # the rate set at the end of `step` (then 0.28 * step s on the clock), used by step + 1
        if step < 5:
            return 3e-3 * step / 5
        return 3e-3 * (1 - min(1.0, (0.28 * step - 0.28 * 5) / (9.0 - 0.28 * 5)))

    used = [log["learning_rate"] for log in logs]  # the rate each step trained with
    assert used == pytest.approx([by_hand(s) for s in range(33)], rel=1e-6, abs=1e-12)
    assert used[-1] > 0.0 and set(trainer.lr_scheduler.get_last_lr()) == {0.0}  # 0 once the budget is spent
    assert logs[-1]["loss"] < 0.8 * logs[0]["loss"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    dtypes.clear()
    translate(model, tok, raw["source"][:4], num_beams=2)
    assert dtypes == {torch.float32}
    assert trainer.model is model


def test_bf16_refused_on_a_cpu_without_bf16_matmul(tmp_path, monkeypatch):
    import hf_hardattn.tools.training

    monkeypatch.setattr(hf_hardattn.tools.training, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    raw = reversal_dataset()
    tok = train_tokenizer(raw, kind="char", min_frequency=1)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(vocab_size=len(tok))))
    with pytest.raises(ValueError, match=r"`bf16`.*AVX512 or AMX.*bf16=False"):
        train_seq2seq(model, tok, tokenize_dataset(raw, tok, max_length=16), output_dir=tmp_path / "run",
                      max_steps=2, progress=False, bf16=True)
    hf_hardattn.tools.training.check_bf16(False)  # fp32 is always allowed


def test_fp16_refused_without_a_gpu_where_accelerate_would_train_fp32(tmp_path, monkeypatch):
    """``fp16=True`` on a CPU: accelerate leaves out fp16 autocast and its loss scaler there (no autocast seen by the
    layers, no scaler: the premise, checked with the refusal bypassed), so train_seq2seq refuses it, naming the
    field."""
    import hf_hardattn.tools.training

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    raw = reversal_dataset()
    tok = train_tokenizer(raw, kind="char", min_frequency=1)
    data = tokenize_dataset(raw, tok, max_length=16)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(vocab_size=len(tok))))
    with pytest.raises(ValueError, match=r"`fp16` asks for fp16 mixed precision.*silently train in fp32"):
        train_seq2seq(model, tok, data, output_dir=tmp_path / "run", max_steps=2, progress=False, fp16=True)
    monkeypatch.setattr(hf_hardattn.tools.training, "check_fp16", lambda fp16: None)
    autocast = []
    model.model.encoder.layers[0].register_forward_hook(
        lambda module, inputs, output: autocast.append(torch.is_autocast_enabled("cpu")) and None)
    trainer = train_seq2seq(model, tok, data, output_dir=tmp_path / "run", max_steps=2, progress=False, fp16=True)
    assert autocast == [False, False] and trainer.accelerator.scaler is None
    hf_hardattn.tools.training.check_fp16(False)  # fp32 is always allowed


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or platform.machine() != "x86_64", reason="x86 Linux only")
def test_bf16_matmul_probe_matches_the_cpu_flags():
    """oneDNN runs bf16 GEMMs natively on x86 CPUs with AVX512 BW + VL + DQ (AVX512-BF16 / AMX make them faster),
    unless its ISA limit (``ONEDNN_MAX_CPU_ISA``, formerly ``DNNL_MAX_CPU_ISA``; case-insensitive) stops below
    AVX512_CORE: then it has no bf16 kernels (e.g. the SSE4.1 limit that the second CI pass sets)."""
    from hf_hardattn.tools.training import cpu_has_bf16_matmul

    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next(line for line in cpuinfo if line.startswith("flags")).split(":")[1].split())
    limit = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    below_avx512 = limit in {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
    assert cpu_has_bf16_matmul() == ({"avx512bw", "avx512vl", "avx512dq"} <= flags and not below_avx512), limit


def test_length_grouped_batches_group_by_source_and_target_length(tmp_path):
    """Batches are grouped by max(source, target) length: with equal short sources and targets of 1..40 tokens,
    transformers' source-length grouping leaves the targets unsorted (heavy padding); ours sorts them."""
    import datasets

    from hf_hardattn.tools.training import example_lengths

    generator = torch.Generator().manual_seed(0)
    target_lengths = torch.randint(1, 41, (800,), generator=generator).tolist()
    data = datasets.Dataset.from_dict({
        "input_ids": [[5, 2]] * 800,  # one source length: source grouping sees no difference
        "attention_mask": [[1, 1]] * 800,
        "labels": [[6] * n + [2] for n in target_lengths],
    })
    assert example_lengths(data) == [n + 1 for n in target_lengths]
    tok = train_tokenizer(reversal_dataset(), kind="char", min_frequency=1)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(vocab_size=len(tok))))
    trainer = train_seq2seq(model, tok, data, output_dir=tmp_path / "run", max_steps=1, batch_size=50,
                            progress=False)

    def target_efficiency():
        real = padded = 0
        for batch in trainer.get_train_dataloader():
            labels = batch["labels"]
            real += int((labels != -100).sum())
            padded += labels.numel()
        return real / padded

    ours = target_efficiency()
    trainer.example_lengths = None  # transformers' own group_by_length: source lengths only
    by_source = target_efficiency()
    assert ours > 0.75 > 0.6 > by_source, (ours, by_source)


class StubModel:
    """generate() answers from a lookup table: decodes each (padded) source row and encodes its known output."""

    def __init__(self, tokenizer, table):
        self.tokenizer, self.table, self.training, self.calls = tokenizer, table, False, []
        self.device = torch.device("cpu")

    def eval(self):
        self.training = False
        return self

    def train(self, mode=True):
        self.training = mode
        return self

    def generate(self, input_ids, attention_mask=None, **kwargs):
        self.calls.append(dict(kwargs, batch=input_ids.shape[0]))
        sources = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        rows = [[1] + self.tokenizer(self.table[s])["input_ids"] for s in sources]
        width = max(map(len, rows))
        return torch.tensor([row + [0] * (width - len(row)) for row in rows])


def test_bleu_and_accuracy_against_hand_values():
    sources = ["a b", "a b c d e f", "c", "d e f g"]
    outputs = {"a b": "the cat sat on the mat", "a b c d e f": "a dog", "c": "hello world", "d e f g": "x y z"}
    references = ["the cat sat on the mat", "the dog", "hello world", "x y w"]
    tok = train_tokenizer(sources + list(outputs.values()) + references, kind="bpe", vocab_size=300, min_frequency=1)
    stub = StubModel(tok, outputs)
    score = bleu(stub, tok, sources, references, num_beams=4, batch_size=3)
    hypotheses = [outputs[s] for s in sources]
    assert score.hypotheses == hypotheses  # original order restored after length sorting
    assert score.score == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert [c["batch"] for c in stub.calls] == [3, 1] and all(c["num_beams"] == 4 for c in stub.calls)
    assert bleu(stub, tok, sources, hypotheses).score == pytest.approx(100.0)
    # exact match: 2 of 4 outputs equal their reference ("the cat ..." and "hello world")
    value, predictions = accuracy(stub, tok, sources, references, return_predictions=True)
    assert value == pytest.approx(0.5) and predictions == hypotheses


def test_decode_speed_forces_length_and_counts_runs(monkeypatch):
    """Sentences per second = batch size / the median time of the timed runs (the warm-up run not counted), each
    forced to exactly the asked number of new tokens; on a clock that each run advances by a set time."""
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs())).eval()
    calls = []
    generate = model.generate
    clock = step_clock(monkeypatch, 0.0)
    durations = [50.0, 1.0, 4.0, 2.0]  # warm-up, then 3 timed runs: median 2 s

    def counted(**kwargs):
        out = generate(**kwargs)
        clock.now += durations[len(calls)]
        calls.append((kwargs["min_new_tokens"], kwargs["max_new_tokens"], out.shape))
        return out

    model.generate = counted
    ids = torch.randint(4, 40, (3, 6))
    speed = decode_speed(model, ids, torch.ones_like(ids), num_beams=1, new_tokens=7, repeats=3)
    assert speed == pytest.approx(3 / 2.0)
    assert len(calls) == 4  # one warm-up + 3 timed runs
    assert all(c[:2] == (7, 7) and c[2] == (3, 8) for c in calls)  # start token + exactly 7 new tokens


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------
def test_demo_end_to_end(tmp_path, capsys, monkeypatch):
    """The demo (50 steps per model, far inside its time budget on any CPU) trains both models (the loss falls) and
    saves exactly the trained weights; what it stores and prints is what the saved models do: each reloaded model's
    greedy outputs on the same 40 test examples (the shuffled test split of german_nouns, drawn here), decoded as the
    demo decodes them, give the stored exact match, and on the printed examples the printed rows; the copy-the-lemma
    baseline and the speed ratio are those of its own figures."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    import hf_hardattn.tools.training
    from hf_hardattn_cli.command import main

    trainers = []
    train = hf_hardattn.tools.training.train_seq2seq

    def recorded(*args, **kwargs):  # the demo's trainers, to compare the saved weights with the trained ones
        trainers.append(train(*args, **kwargs))
        return trainers[-1]

    monkeypatch.setattr(hf_hardattn.tools.training, "train_seq2seq", recorded)
    out = tmp_path / "demo"
    main(["demo", "--tiny", "--minutes", "10", "--max-steps", "50", "--max-examples", "2000", "--eval-examples", "40",
          "--speed-batch", "4", "--speed-tokens", "4", "--speed-rounds", "1", "--show", "3",
          "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert "speed ratio hard/soft" in printed and "(same predictions as before saving: " in printed
    test = german_nouns(seed=0, max_examples=2000)["test"].shuffle(seed=0).select(range(40))
    results = json.loads((out / "demo_results.json").read_text())
    copy_baseline = sum(a == b for a, b in zip(test["lemma"], test["target"])) / 40
    assert results["eval_examples"] == 40 and results["copy_baseline"] == pytest.approx(copy_baseline)
    assert f"copy-the-lemma baseline: {100 * copy_baseline:.1f}%" in printed
    assert len(trainers) == 2
    for trainer, (name, model_type) in zip(trainers, (("soft", "soft_transformer"),
                                                     ("hard", "hard_retrieval_transformer"))):
        folder = out / name
        for file in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
            assert (folder / file).exists(), (name, file)
        result = results["results"][name]
        assert result["steps"] == trainer.state.global_step == 50, result
        assert result["last_loss"] < result["first_loss"], result
        trained = trainer.model.state_dict()
        assert all(torch.equal(weight, trained[key]) for key, weight in load_file(folder / "model.safetensors").items())
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        assert model.config.model_type == model_type
        # decoded as the demo scores (greedy, all 40 in one batch, --max-length 64): the same computation
        predictions = translate(model, tok, test["source"], num_beams=1, batch_size=250, max_new_tokens=64)
        exact = sum(p == t.strip() for p, t in zip(predictions, test["target"])) / 40
        assert result["accuracy"] == exact
        card = (folder / "README.md").read_text()
        assert model_type in card and f"| test exact match (greedy) | {100 * exact:.1f}% on 40 examples |" in card
        assert "| training | 50 steps, " in card
    # the printed examples: the reloaded hard model's outputs for them (decoded together, as the demo does)
    shown = printed.split("unseen test lemmas:\n")[1].split("\n\n")[0].splitlines()[1:]
    labels = [f"  {lemma:<26} {(f'<{g}> ' if g else '') + tag:<16} " for lemma, g, tag in
              zip(test["lemma"], test["gender"], test["tag"])]
    picks = [next(i for i, label in enumerate(labels) if row.startswith(label)) for row in shown]
    outputs = translate(model, tok, [test["source"][i] for i in picks], num_beams=1, max_new_tokens=64)
    assert len(shown) == 3 and shown == [f"{labels[i]}{p:<28} {test['target'][i]}  "
                                         f"{'ok' if p == test['target'][i] else '--'}" for i, p in zip(picks, outputs)]
    speeds = [results["results"][name]["sentences_per_second"] for name in ("hard", "soft")]
    assert min(speeds) > 0 and results["speed_ratio_hard_over_soft"] == pytest.approx(speeds[0] / speeds[1])


def test_tokenizer_command(tmp_path, monkeypatch):
    """``python -m hf_hardattn tokenizer ...`` (run in-process through the package's __main__)."""
    import runpy

    write(tmp_path / "train.en.gz", CORPUS, True)
    write(tmp_path / "train.de.gz", DE, True)
    argv = ["hf_hardattn", "tokenizer", "--files", str(tmp_path / "train.en.gz"), str(tmp_path / "train.de.gz"),
            "--vocab-size", "300", "--out", str(tmp_path / "tok")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("hf_hardattn", run_name="__main__")
    assert exit_info.value.code == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(tok) == 300
    assert tok.decode(tok(DE[0])["input_ids"], skip_special_tokens=True) == DE[0]


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_the_trainer_warns_after_a_load_only_of_names_no_loaded_name_holds(name, tmp_path, monkeypatch):
    """A checkpoint stores a tied parameter once, so ``load_state_dict`` (the Trainer's ``load_best_model_at_end``,
    a resumed run) reports its other names missing (stock models too). Our trainers (Seq2SeqCardTrainer and
    train_seq2seq's Seq2SeqLengthTrainer) warn of a missing name only where no loaded name holds its parameter.
    References: torch's own missing keys, and the names that ``named_parameters`` gives one parameter."""
    import transformers.trainer
    from transformers import Seq2SeqTrainingArguments
    from safetensors.torch import load_file

    from hf_hardattn.tools.trainer_card import Seq2SeqCardTrainer
    from hf_hardattn.tools.training import Seq2SeqLengthTrainer

    model = TYPE_MODELS[name]()
    model.save_pretrained(tmp_path / "saved")
    stored = load_file(tmp_path / "saved" / "model.safetensors")
    groups = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(key)
    tied = [sorted(keys) for keys in groups.values() if len(keys) > 1]
    assert tied, "every type ties its embeddings and output layer"
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    warned = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda message, *a, **k: warned.append(message))

    def load(trainer, state):
        warned.clear()
        result = model.load_state_dict(state, strict=False)
        trainer._issue_warnings_after_load(result)
        return result

    for trainer in (Seq2SeqCardTrainer(model=model, args=args), Seq2SeqLengthTrainer(model=model, args=args)):
        result = load(trainer, stored)  # the checkpoint as saved: every tied name but one is missing to torch
        assert sorted(result.missing_keys) == sorted(k for keys in tied for k in keys if k not in stored)
        assert result.missing_keys and warned == []
        lost = next(key for key in stored if all(key not in keys for keys in tied))  # a name nothing else holds
        load(trainer, {key: value for key, value in stored.items() if key != lost})
        assert len(warned) == 1 and f"'{lost}'" in warned[0]
        assert all(f"'{key}'" not in warned[0] for keys in tied for key in keys)
        group = tied[0]  # every name of a tied parameter missing: all of them are named
        load(trainer, {key: value for key, value in stored.items() if key not in group})
        assert len(warned) == 1 and all(f"'{key}'" in warned[0] for key in group)
