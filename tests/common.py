"""Shared checks every hf_hardattn variant must pass (tiny configs, offline).

Each variant's test module calls these with its own model factory, so the HF-integration contract (cache ==
no-cache, padded batch == single, save/load, remote code in a fresh process, Trainer) is tested the same way
for all of them.
"""

import copy
import itertools
import json
import os
import subprocess
import sys
import textwrap

import torch

from hf_hardattn.model_card import MIN_TRANSFORMERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 40
PAD, BOS, EOS = 0, 1, 2


def tiny_kwargs(**overrides):
    """Sizes for fast tests; all special tokens inside the vocabulary."""
    kwargs = dict(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
    )
    kwargs.update(overrides)
    return kwargs


def randomize(model, std=0.5, seed=0):
    """Non-trivial random weights: every matrix N(0, std) so that attention is far from uniform and any cache or
    batching bug changes the output. Norm gains stay 1 and biases small."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def source_batch():
    """Two sources of different length, the second right-padded (attention mask 0 on padding)."""
    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 2], [7, 11, 19, 23, 2, PAD, PAD]])
    return ids, (ids != PAD).long()


def generate_kwargs(mode):
    forced = dict(max_new_tokens=10, min_new_tokens=10)
    if mode == "greedy":
        return dict(do_sample=False, **forced)
    if mode == "beam":
        return dict(num_beams=4, num_return_sequences=2, do_sample=False, **forced)
    if mode == "sample":
        return dict(do_sample=True, top_k=0, **forced)
    raise ValueError(mode)


def run_generate(model, mode, use_cache, input_ids=None, attention_mask=None):
    if input_ids is None:
        input_ids, attention_mask = source_batch()
    if mode == "sample":
        torch.manual_seed(1234)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache,
                          **generate_kwargs(mode))


MIN_DISTINCT_TOKENS = 4


def is_nontrivial(tokens):
    return len(torch.unique(tokens)) >= MIN_DISTINCT_TOKENS


def assert_nontrivial(tokens):
    """Guards the equivalence checks: outputs that repeat one token could hide a bug (`fitted` aims above it)."""
    assert is_nontrivial(tokens), f"degenerate output, the check could not fail: {tokens.tolist()}"


def check_cache_equivalence(model):
    for mode in ("greedy", "beam", "sample"):
        cached, uncached = run_generate(model, mode, True), run_generate(model, mode, False)
        assert_nontrivial(cached)
        assert torch.equal(cached, uncached), f"{mode}: cache {cached.tolist()} != no cache {uncached.tolist()}"


GROUPED_MODES = {  # generate() settings that repeat each sentence: beams, returned sequences, both
    "beam": dict(num_beams=4, num_return_sequences=2),
    "sample": dict(do_sample=True, top_k=0, num_return_sequences=3),
    "beam_sample": dict(do_sample=True, num_beams=3, num_return_sequences=3),
}


def check_grouped_memory(model, mode):
    """generate() leaves the encoder output at one row per sentence (grouped memory: source keys/values projected and
    cached once per sentence); the reference is the same model on transformers' expansion to one row per beam.
    Tokens equal, step scores within 1e-4, and the cached source keys have one row per sentence (per beam on the
    reference path)."""
    from hf_hardattn.modeling_hardattn import CACHE_FIELD

    assert model._memory_grouped_decoding()
    expanded = copy.deepcopy(model)
    expanded._memory_grouped_decoding = lambda: False
    ids, mask = source_batch()
    results = {}
    for key, m in (("grouped", model), ("expanded", expanded)):
        torch.manual_seed(1234)
        results[key] = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                                  return_dict_in_generate=True, output_scores=True, **GROUPED_MODES[mode])
    grouped, reference = results["grouped"], results["expanded"]
    assert_nontrivial(grouped.sequences)
    assert torch.equal(grouped.sequences, reference.sequences)
    for a, b in zip(grouped.scores, reference.scores):
        assert torch.allclose(a, b, atol=1e-4)
    expand = max(GROUPED_MODES[mode].get("num_beams", 1), GROUPED_MODES[mode]["num_return_sequences"])
    rows = {key: {layer.keys.shape[0] for layer in getattr(out, CACHE_FIELD).cross_attention_cache.layers
                  if layer.is_initialized} for key, out in results.items()}
    assert rows == {"grouped": {ids.shape[0]}, "expanded": {ids.shape[0] * expand}}


def check_padded_batch(model, modes=("greedy", "beam")):
    ids, mask = source_batch()
    for mode in modes:
        batched = run_generate(model, mode, True, ids, mask)
        per_row = batched.shape[0] // ids.shape[0]
        for i in range(ids.shape[0]):
            length = int(mask[i].sum())
            single = run_generate(model, mode, True, ids[i : i + 1, :length], mask[i : i + 1, :length])
            expected = batched[i * per_row : (i + 1) * per_row, : single.shape[1]]
            assert torch.equal(single, expected), f"{mode}: row {i} alone {single.tolist()} != in batch {expected.tolist()}"


def check_save_load(model, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    card = (tmp_path / "README.md").read_text()
    assert model.config.model_type in card
    assert f"`transformers>={MIN_TRANSFORMERS}`" in card
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    for mode in ("greedy", "beam"):
        assert torch.equal(run_generate(model, mode, True), run_generate(reloaded, mode, True))
    return reloaded


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys, os
    os.environ["HF_HUB_OFFLINE"] = "1"
    # hf_hardattn must NOT be importable: drop every path that could provide it
    sys.path = [p for p in sys.path if p and os.path.abspath(p) != os.path.abspath(sys.argv[2])]
    sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                     and "editable" not in type(f).__module__]
    sys.path_hooks = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
    sys.path_importer_cache.clear()
    try:
        import hf_hardattn  # noqa
        raise SystemExit("hf_hardattn is importable in the fresh process")
    except ImportError:
        pass
    import torch
    from transformers import AutoModelForSeq2SeqLM
    model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    ids = torch.tensor(json.loads(sys.argv[3]))
    mask = (ids != 0).long()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    beam = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=4)
    model.pack_linears()  # the CPU decoding option travels with the remote code
    packed = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=4)
    print("RESULT" + json.dumps({"greedy": out.tolist(), "beam": beam.tolist(), "packed_beam": packed.tolist(),
                                 "class": type(model).__module__}))
    """
)


def check_remote_code(model, tmp_path):
    """Save, then load in a fresh process where hf_hardattn is not importable, offline, with trust_remote_code."""
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" in config and "AutoModelForSeq2SeqLM" in config["auto_map"]
    ids, mask = source_batch()
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", HF_MODULES_CACHE=str(tmp_path / "modules_cache"))
    script = tmp_path / "remote_load.py"
    script.write_text(REMOTE_SCRIPT)
    # run from an empty folder; the script removes the project path and the editable-install finder
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), repo_root, json.dumps(ids.tolist())],
        capture_output=True, text=True, env=env, cwd=workdir, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["class"].startswith("transformers_modules"), result["class"]
    greedy = run_generate(model, "greedy", True)
    assert result["greedy"] == greedy.tolist()
    beam = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=4)
    assert result["beam"] == beam.tolist() == result["packed_beam"]


def copy_rows(seed=0, length=(3, 8)):
    """Toy task: the target is the source reversed. An endless stream of {input_ids, labels} dicts."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        size = int(torch.randint(length[0], length[1] + 1, (1,), generator=generator))
        src = torch.randint(4, VOCAB, (size,), generator=generator).tolist()
        yield {"input_ids": src + [EOS], "attention_mask": [1] * (size + 1), "labels": src[::-1] + [EOS]}


def copy_task(n=256, seed=0, length=(3, 8)):
    """The first `n` rows of `copy_rows`, as a list."""
    return list(itertools.islice(copy_rows(seed, length), n))


def toy_tokenizer():
    """A real PreTrainedTokenizerFast over the toy vocabulary (word-level: token i is 't{i}')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def check_trainer(model, tmp_path, steps=60, lr=5e-3, batch_size=16):
    """~60 Seq2SeqTrainer steps on the reversal task lower the loss clearly; predict_with_generate gives a sacrebleu
    BLEU. Returns (first_loss, last_loss, bleu)."""
    import sacrebleu
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    tokenizer = toy_tokenizer()
    train, test = copy_task(512, seed=0), copy_task(16, seed=1)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=batch_size, per_device_eval_batch_size=16,
        learning_rate=lr, max_steps=steps, logging_steps=5, save_strategy="no", report_to=[], seed=0,
        predict_with_generate=True, generation_max_length=12, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, warmup_steps=5, lr_scheduler_type="constant_with_warmup",
    )

    def metrics(eval_pred):
        preds, labels = eval_pred
        preds = [[t for t in row if t > EOS] for row in preds.tolist()]
        labels = [[t for t in row if t > EOS] for row in labels.tolist()]
        hyps = [" ".join(map(str, p)) for p in preds]
        refs = [" ".join(map(str, r)) for r in labels]
        return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score}

    trainer = Seq2SeqTrainer(
        model=model.train(), args=args, train_dataset=train, eval_dataset=test, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), compute_metrics=metrics,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    prediction = trainer.predict(test, max_new_tokens=12)
    assert losses[-1] < 0.8 * losses[0], f"loss did not drop clearly: {losses}"
    assert "test_bleu" in prediction.metrics
    return losses[0], losses[-1], prediction.metrics["test_bleu"]


def collate(rows):
    """Pad a list of copy_task rows into a batch (labels padded with -100)."""
    width = max(len(r["input_ids"]) for r in rows)
    target = max(len(r["labels"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (target - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


def fitted(model, steps=150, lr=5e-3, seed=0, max_rounds=3):
    """Weights that make the cache/batching checks able to fail. Random tied-embedding models (even N(0, 0.5)) decode
    one repeated token, so any cache bug would go unseen; a model briefly fitted (150 Adam steps, ~2 s) on the
    reversal task emits varied tokens that depend on the source, the prefix and the position. Callers still assert
    that with `assert_nontrivial`.

    The fit is not bit-identical across CPUs and thread counts (GEMM rounding; a hard-attention model's sampled
    training amplifies it), and on some a 150-step model still repeats one or two tokens. So while greedy or beam
    decoding of `source_batch()` is not `is_nontrivial`, it trains `steps` more on new rows, up to `max_rounds`
    rounds in all; where the first round suffices, the weights are exactly those of one round."""
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rows = copy_rows(seed)  # one stream: a later round continues where the previous one stopped
    for round_ in range(max_rounds):
        model.train()
        for _ in range(steps):
            loss = model(**collate(list(itertools.islice(rows, 16)))).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        last = round_ == max_rounds - 1  # after the last round the check decides nothing: the caller asserts
        if last or all(is_nontrivial(run_generate(model, mode, True)) for mode in ("greedy", "beam")):
            break
    return model


def beam_result(model):
    """Beam search (cached) sequences and their final scores: a negative control compares the scores, which any
    change of the decoder state moves, rather than the tokens, which may survive it by luck."""
    ids, mask = source_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, use_cache=True, output_scores=True,
                         return_dict_in_generate=True, **generate_kwargs("beam"))
    return out.sequences, out.sequences_scores


def decode_step_by_step(model, decoder_ids, cache_kwarg="cache", **inputs):
    """Logits of ``decoder_ids`` decoded one position per call through the KV cache (``inputs``: the source, or
    ``encoder_outputs``), concatenated over time; and the final cache. ``cache_kwarg``: the name forward() gets the
    cache under (``"past_key_values"`` before transformers 5.24)."""
    from hf_hardattn.modeling_hardattn import CACHE_FIELD

    cache, logits = None, []
    for t in range(decoder_ids.shape[1]):
        out = model(**inputs, decoder_input_ids=decoder_ids[:, t : t + 1], use_cache=True, **{cache_kwarg: cache})
        cache = getattr(out, CACHE_FIELD)
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


# -- one tiny model per model type (and per behaviour that differs within a type), for the contract tests -----------
def _contract_builders():
    import hf_hardattn as h

    def kw(**overrides):
        return tiny_kwargs(**overrides)

    rnn = dict(decoder_layers=1, rnn_hidden_size=32)
    return {
        "soft": lambda: h.SoftTransformerForConditionalGeneration(h.SoftTransformerConfig(**kw())),
        "soft_prenorm": lambda: h.SoftTransformerForConditionalGeneration(
            h.SoftTransformerConfig(**kw(normalize_before=True, position_embedding="learned"))),
        "hard_retrieval": lambda: h.HardRetrievalForConditionalGeneration(
            h.HardRetrievalConfig(**kw(encoder_attention="hard_retrieval"))),
        "gaussian_hc_all": lambda: h.GaussianForConditionalGeneration(
            h.GaussianConfig.preset("hc-all", **kw(length_ratio=1.0))),
        "gaussian_sh_x": lambda: h.GaussianForConditionalGeneration(h.GaussianConfig.preset("sh-x", **kw())),
        "hybrid_additive": lambda: h.HybridForConditionalGeneration(h.HybridConfig(**kw(**rnn))),
        "hybrid_multihead": lambda: h.HybridForConditionalGeneration(
            h.HybridConfig(**kw(**dict(rnn, decoder_layers=2), rnn_attention="multihead"))),
        "hybrid_luong_lstm": lambda: h.HybridForConditionalGeneration(h.HybridConfig(**kw(
            **dict(rnn, decoder_layers=2), rnn_attention="dot", rnn_decoder_style="luong", rnn_cell="lstm"))),
        "recurrent_expand_1": lambda: h.RecurrentForConditionalGeneration(h.RecurrentConfig(**kw())),
        "recurrent_coverage": lambda: h.RecurrentForConditionalGeneration(
            h.RecurrentConfig(**kw(recurrent_variant="coverage", cross_attention=["soft", "recurrent"]))),
        "beam_joint_transformer": lambda: h.BeamJointTransformerForConditionalGeneration(
            h.BeamJointTransformerConfig(**kw(joint_k=3, joint_layer=0))),
        "beam_joint_rnn": lambda: h.BeamJointRNNForConditionalGeneration(  # the paper's Luong-style LSTM decoder
            h.BeamJointRNNConfig(**kw(**rnn, joint_k=3, rnn_attention="multihead"))),
        "beam_joint_rnn_bahdanau": lambda: h.BeamJointRNNForConditionalGeneration(h.BeamJointRNNConfig(**kw(
            **rnn, joint_k=3, rnn_attention="additive", rnn_decoder_style="bahdanau", rnn_cell="gru"))),
    }


CONTRACT_MODELS = tuple(_contract_builders())  # the names; every model type is among them
_CONTRACT_FITTED = {}


def contract_model(name, fit=True):
    """A tiny model of contract configuration ``name``: fitted on the reversal task (shared, built once per session:
    do not modify it, deep-copy first) or, with ``fit=False``, a fresh randomized one."""
    if not fit:
        torch.manual_seed(0)
        return randomize(_contract_builders()[name]())
    if name not in _CONTRACT_FITTED:
        torch.manual_seed(0)  # the same initial weights whichever test asks first
        _CONTRACT_FITTED[name] = fitted(_contract_builders()[name](), steps=100)
    return _CONTRACT_FITTED[name]
