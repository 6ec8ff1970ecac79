"""``hf-hardattn translate`` and ``hf-hardattn score``: the outputs against the independent paths they wrap
(``model.generate`` sentence by sentence, sacrebleu's own command line), file handling, and one-line errors."""

import copy
import gzip
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

from common import FP32_PATHS_RTOL, memorise, tiny_kwargs
from hf_hardattn import (HardRetrievalConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.packed_linear import packing_available
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn_cli.command import main

os.environ["HF_HUB_OFFLINE"] = "1"
SOURCES = ["a b c", "c b a d e", "e e d", "b", "d c b a e c", "a a"]
REVERSED = [source[::-1] for source in SOURCES]  # what the fitted soft model translates SOURCES to
MARGIN = 1.0  # logits: each memorised token wins by this much


def reversal_batch(tok):
    """SOURCES with their reversals as labels (padding: -100), the fitted soft model's training batch."""
    batch = tok(SOURCES, padding=True, return_tensors="pt")
    labels = tok(REVERSED, padding=True, return_tensors="pt")
    batch["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
    return batch


def reversal_margins(model, tok, dtype=torch.float64):
    """Per target token of the reversals (teacher-forced, in ``dtype``): its logit minus the best other logit; and the
    largest |logit|."""
    batch = reversal_batch(tok)
    with torch.no_grad():
        logits = copy.deepcopy(model).to(dtype).eval()(**batch).logits
    labels = batch["labels"].clamp(min=0)[..., None]
    margins = logits.gather(-1, labels)[..., 0] - logits.scatter(-1, labels, float("-inf")).amax(-1)
    return margins[batch["labels"] != -100], logits.abs().max().item()


def fitted_soft(config, tok):
    """A tiny soft model fitted (in float64) until it has memorised the reversal of every source by MARGIN, checked
    on its fp32 weights whatever the CPU's rounding: its greedy output is varied and known by construction. Returned
    in fp32."""
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(config).double()
    step = memorise(model, reversal_batch(tok), lambda m: reversal_margins(copy.deepcopy(m).float(), tok)[0], MARGIN,
                    max_steps=400)
    model = model.float().eval()
    margins = reversal_margins(model, tok)[0]
    assert margins.min() >= MARGIN, (f"the tiny soft model did not memorise the reversals in {step} steps (smallest "
                                     f"margin {margins.min():.3g} < {MARGIN}): the packed-decoding check needs them")
    return model


def varied(outputs):
    """Non-empty and all different: equality with the sentences decoded alone cannot hold by a degenerate (empty,
    constant) output, nor survive rows mixed up."""
    return all(outputs) and len(set(outputs)) == len(outputs)


def memorised_float64(model, tok, learning_rate=3e-3):
    """``model`` in float64, fitted until it has memorised the reversal of every source by MARGIN (in float64): its
    greedy outputs on SOURCES, each alone, are REVERSED by construction, non-empty and all different (`varied`), so a
    batch that mixed up, dropped or misaligned rows changes the text; float64, so that a padded batch and the source
    alone (two code paths) agree to ~1e-15 and no rounding decides a near tie between them (see common.as_float64)."""
    torch.manual_seed(0)
    model = model.double()
    step = memorise(model, reversal_batch(tok), lambda m: reversal_margins(m, tok)[0], MARGIN, max_steps=400,
                    learning_rate=learning_rate)
    margins = reversal_margins(model, tok)[0]
    assert margins.min() >= MARGIN, (f"{type(model).__name__} did not memorise the reversals in {step} steps "
                                     f"(smallest margin {margins.min():.3g} < {MARGIN})")
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny hard-retrieval model, a tiny fitted soft model and a tiny MarianMTModel, each saved with the same
    tokenizer; and float64 copies of the first and the last that memorised the reversals (`memorised_float64`),
    for the comparisons of batched decoding with one sentence at a time ("hard64", "marian64")."""
    folder = tmp_path_factory.mktemp("models")
    tok = train_tokenizer(SOURCES * 3, kind="char", min_frequency=1)
    special = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   decoder_start_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    hard = HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs(**special, bos_token_id=tok.bos_token_id)))
    hard.save_pretrained(folder / "hard", tokenizer=tok)
    config = SoftTransformerConfig(**tiny_kwargs(**special, bos_token_id=tok.bos_token_id))
    fitted_soft(config, tok).save_pretrained(folder / "soft", tokenizer=tok)
    marian = MarianMTModel(MarianConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                        max_position_embeddings=64, **special))
    marian.save_pretrained(folder / "marian")
    tok.save_pretrained(folder / "marian")
    memorised_float64(copy.deepcopy(hard), tok).save_pretrained(folder / "hard64", tokenizer=tok)
    memorised_float64(copy.deepcopy(marian), tok, learning_rate=1e-2).save_pretrained(folder / "marian64")
    tok.save_pretrained(folder / "marian64")
    return folder, tok


def one_by_one(folder, tok, sources, **kwargs):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    out = []
    for source in sources:
        ids = model.generate(**tok([source], return_tensors="pt"), max_new_tokens=12, **kwargs)
        out.append(tok.decode(ids[0], skip_special_tokens=True).strip())
    return out


@pytest.mark.parametrize("name", ["hard64", "marian64"])
@pytest.mark.numerics
def test_translate_file_equals_generate_sentence_by_sentence(saved, tmp_path, name, capsys):
    """Batches of 2 (padded) against each sentence alone, exact text: float64 models (two code paths, see
    `memorised_float64`) whose outputs are non-empty and differ between sentences, so equality cannot hold by a
    degenerate output."""
    folder, tok = saved
    lines = SOURCES[:3] + [""] + SOURCES[3:]  # an empty line stays empty, in place
    source = tmp_path / "in.txt.gz"
    with gzip.open(source, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    assert main(["translate", str(folder / name), "-i", str(source), "-o", str(out), "--num-beams", "3",
                 "--batch-size", "2", "--threads", "1", "--max-new-tokens", "12"]) == 0
    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) == len(lines) + 1
    want = one_by_one(folder / name, tok, SOURCES, num_beams=3)
    assert got[:3] + got[4:-1] == want and got[3] == ""
    assert varied(want), want  # a mix-up of sentences would show
    assert "sentences/s" in capsys.readouterr().err
    assert not os.path.exists(str(out) + ".partial")


def test_translate_stdin_to_stdout_and_sampling_seed(saved, monkeypatch, capsys):
    folder, _ = saved
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(SOURCES) + "\n"))
    assert main(["translate", str(folder / "hard64"), "--num-beams", "1", "--quiet", "--threads", "1",
                 "--max-new-tokens", "12"]) == 0
    greedy = capsys.readouterr().out.splitlines()  # batched, float64: see `memorised_float64`
    assert greedy == one_by_one(folder / "hard64", saved[1], SOURCES, num_beams=1, do_sample=False)
    assert varied(greedy), greedy

    def sample(seed):
        monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(SOURCES * 4) + "\n"))
        assert main(["translate", str(folder / "hard"), "--num-beams", "1", "--do-sample", "--top-k", "50",
                     "--temperature", "3", "--seed", str(seed), "--quiet", "--threads", "1"]) == 0
        return capsys.readouterr().out.splitlines()

    first = sample(1)
    assert first == sample(1) and first != sample(2)  # seeded, and really sampled
    assert first != greedy * 4


@pytest.mark.skipif(not packing_available(), reason="no oneDNN prepacked linear (pack_linears needs it)")
def test_translate_pack_linears_gives_the_same_output(saved, tmp_path):
    """Greedy decoding with and without --pack-linears (two fp32 GEMM kernels) gives the same lines, on a fitted soft
    model whose every decision is clear of their rounding: each token's logit margin (teacher-forced, fp32) exceeds
    twice the bound on how far two fp32 paths' logits may part (common.FP32_PATHS_RTOL of the largest |logit|), so
    both decode the memorised reversals; all of its ~40 tokens are compared. (A soft model: its only decisions are
    the output argmaxes whose margins are read here; a hard-retrieval key choice would need its own margins.)"""
    folder, tok = saved
    margins, largest = reversal_margins(SoftTransformerForConditionalGeneration.from_pretrained(folder / "soft"), tok,
                                        torch.float32)
    bound = FP32_PATHS_RTOL * largest
    assert margins.numel() >= 30 and margins.min() > 2 * bound, (f"a decision within rounding of a tie: smallest "
                                                                  f"margin {margins.min():.3g} <= 2 x {bound:.3g}")
    source = tmp_path / "in.txt"
    source.write_text("\n".join(SOURCES), encoding="utf-8")
    outputs = []
    for extra in ([], ["--pack-linears"]):
        out = tmp_path / f"out{len(extra)}.txt"
        assert main(["translate", str(folder / "soft"), "-i", str(source), "-o", str(out), "--quiet",
                     "--threads", "1", "--num-beams", "1", *extra]) == 0
        outputs.append(out.read_text().splitlines())
    assert outputs[0] == REVERSED  # varied, source-dependent: the comparison below could fail
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_translate_dtype_decodes_in_that_dtype_on_the_device(saved, tmp_path, monkeypatch, dtype, capsys):
    """``--dtype bfloat16|float16 --device cpu``: the model decodes with its weights in that dtype on that device
    (recorded at the call), and greedy decoding gives the memorised reversals. Premise: every teacher-forced
    decision of the fitted soft model, computed in that dtype, is still won by a clear margin (its float64 margins
    are at least MARGIN), so a correct half-precision decoder outputs REVERSED."""
    from hf_hardattn.tools import training

    folder, tok = saved
    margins, _ = reversal_margins(SoftTransformerForConditionalGeneration.from_pretrained(folder / "soft"), tok,
                                  getattr(torch, dtype))
    assert margins.min() > MARGIN / 4, f"a decision within {dtype} rounding: smallest margin {margins.min():.3g}"
    seen, translate = [], training.translate
    monkeypatch.setattr(training, "translate", lambda model, *a, **kw: seen.append(
        {(p.dtype, p.device.type) for p in model.parameters()}) or translate(model, *a, **kw))
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(SOURCES), encoding="utf-8")
    assert main(["translate", str(folder / "soft"), "-i", str(source), "-o", str(out), "--threads", "1",
                 "--num-beams", "1", "--dtype", dtype, "--device", "cpu"]) == 0
    assert seen == [{(getattr(torch, dtype), "cpu")}]
    assert out.read_text().splitlines() == REVERSED
    assert f"{dtype}, 1 thread)" in capsys.readouterr().err


def test_translate_device_defaults_to_the_accelerator_and_checks_it(monkeypatch):
    """Without ``--device``: the accelerator torch sees (here faked: two CUDA devices), the CPU where there is none
    or where --int8 / --pack-linears ask for CPU kernels. ``--device`` is checked against what torch sees."""
    import argparse

    from hf_hardattn.tools.cli import translation_device
    from hf_hardattn_cli.arguments import CommandError

    def args(device=None, int8=False, pack_linears=False):
        return argparse.Namespace(device=device, int8=int8, pack_linears=pack_linears)

    assert translation_device(args()) == torch.device("cpu") == translation_device(args("cpu"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert translation_device(args()) == torch.device("cuda")
    assert translation_device(args(int8=True)) == translation_device(args(pack_linears=True)) == torch.device("cpu")
    assert translation_device(args("cuda:1")) == torch.device("cuda:1")
    for device, message in [("cuda:2", "--device='cuda:2' is not available: torch sees 2 cuda device(s); allowed: cpu, "
                                        "cuda, cuda:0 to 1."), ("mps", "--device='mps' is not available")]:
        with pytest.raises(CommandError, match=re.escape(message)):
            translation_device(args(device))


@pytest.mark.parametrize("engine", [None, "fbgemm", "onednn"])
def test_translate_int8_quantizes_for_the_engine_and_writes_one_line_per_source(saved, tmp_path, monkeypatch, engine):
    from hf_hardattn.int8 import Int8Mixin

    calls, quantize = [], Int8Mixin.quantize_int8
    monkeypatch.setattr(Int8Mixin, "quantize_int8", lambda self, **kw: calls.append(kw) or quantize(self, **kw))
    folder, _ = saved
    source = tmp_path / "in.txt"
    source.write_text("\n".join(SOURCES), encoding="utf-8")
    out = tmp_path / "int8.txt"  # int8 layers: one line per source (the outputs may differ from fp32)
    assert main(["translate", str(folder / "hard"), "-i", str(source), "-o", str(out), "--quiet", "--threads", "1",
                 "--int8", *(["--int8-engine", engine] if engine else [])]) == 0
    assert calls == [dict(engine=engine or "fbgemm")]
    assert len(out.read_text().splitlines()) == len(SOURCES)


def test_pack_linears_without_onednn_packing_is_one_line_error(saved, tmp_path, monkeypatch, capsys):
    """Where torch lacks oneDNN's prepacked linear, --pack-linears is refused at the option (not a RuntimeError deep
    in pack_linears after the model loaded)."""
    import hf_hardattn.packed_linear

    monkeypatch.setattr(hf_hardattn.packed_linear, "packing_available", lambda: False)
    folder, _ = saved
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    assert main(["translate", str(folder / "hard"), "-i", str(source), "-o", str(tmp_path / "out.txt"), "--quiet",
                 "--pack-linears"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hf-hardattn translate: error: --pack-linears needs oneDNN's prepacked linear layers")


@pytest.mark.parametrize("case", ["missing input", "not a model", "too long", "pack marian", "beyond positions",
                                  "int8 packed", "int8 bf16", "engine without int8", "not a device",
                                  "no such device", "int8 off the cpu", "bad beams", "bad top-p"])
def test_translate_bad_input_is_one_line_error(saved, tmp_path, case, capsys):
    folder, _ = saved
    good = tmp_path / "in.txt"
    good.write_text("a b\n" + "a " * 200 + "\n", encoding="utf-8")
    argv = {"missing input": ["translate", str(folder / "hard"), "-i", str(tmp_path / "nope.txt")],
            "not a model": ["translate", str(tmp_path), "-i", str(good)],
            "too long": ["translate", str(folder / "hard"), "-i", str(good), "--max-source-tokens", "50"],
            "pack marian": ["translate", str(folder / "marian"), "-i", str(good), "--pack-linears"],
            "beyond positions": ["translate", str(folder / "hard"), "-i", str(good), "--max-source-tokens", "100000"],
            "int8 packed": ["translate", str(folder / "hard"), "-i", str(good), "--int8", "--pack-linears"],
            "int8 bf16": ["translate", str(folder / "hard"), "-i", str(good), "--int8", "--dtype", "bfloat16"],
            "engine without int8": ["translate", str(folder / "hard"), "-i", str(good), "--int8-engine", "onednn"],
            "not a device": ["translate", str(folder / "hard"), "-i", str(good), "--device", "gpu"],
            "no such device": ["translate", str(folder / "hard"), "-i", str(good), "--device", "meta"],
            "int8 off the cpu": ["translate", str(folder / "hard"), "-i", str(good), "--int8", "--device", "cuda"],
            "bad beams": ["translate", str(folder / "hard"), "--num-beams", "0"],
            "bad top-p": ["translate", str(folder / "hard"), "--top-p", "-1"]}[case]
    out = tmp_path / "out.txt"
    if case.startswith("bad"):  # argparse: exit status 2 and the option named
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert ("--num-beams" if "beams" in case else "--top-p") in capsys.readouterr().err
        return
    assert main(argv + ["-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after transformers' loading bar)
    assert err.startswith("hf-hardattn translate: error:")
    expected = {"missing input": "--input=", "not a model": "MODEL=", "too long": "line 2",
                "pack marian": "--pack-linears", "beyond positions": "max_position_embeddings=",
                "int8 packed": "--int8 and --pack-linears exclude", "int8 bf16": "--int8 and --dtype bfloat16",
                "engine without int8": "--int8-engine=onednn needs --int8",
                "not a device": "--device='gpu' is not a torch device; allowed: cpu, cuda, cuda:N",
                "no such device": "--device='meta' is not available: torch sees no accelerator; allowed: cpu.",
                "int8 off the cpu": "--int8 run CPU kernels, not on --device=cuda"}[case]
    assert expected in err
    assert not out.exists()  # nothing written


HYPOTHESES = ["the cat sat on the mat", "a dog runs", "hello world", "x y z w"]
REFERENCES = [["the cat sat on a mat", "the dog runs", "hello world", "x y w"],
              ["a cat sat on the mat", "a dog is running", "hello , world", "x y z"]]


def sacrebleu_cli(hyp, refs, *options):
    """sacrebleu's own command line: the independent reference (its JSON output)."""
    proc = subprocess.run([sys.executable, "-m", "sacrebleu", *refs, "-i", hyp, *options],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


@pytest.mark.parametrize("nrefs, options", [(1, []), (2, []), (2, ["--lowercase"]), (1, ["--tokenize", "char"])])
def test_score_equals_sacrebleus_own_command(tmp_path, nrefs, options, capsys):
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("\n".join(HYPOTHESES) + "\n", encoding="utf-8")
    refs = []
    for k in range(nrefs):
        path = tmp_path / f"ref{k}.txt.gz"
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write("\n".join(REFERENCES[k]) + "\n")
        refs.append(str(path))
    assert main(["score", str(hyp), *refs, "--json", *options]) == 0
    ours = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    plain_refs = []
    for k in range(nrefs):  # sacrebleu's CLI reads plain files
        path = tmp_path / f"plain{k}.txt"
        path.write_text("\n".join(REFERENCES[k]) + "\n", encoding="utf-8")
        plain_refs.append(str(path))
    lower = "--lowercase" in options
    tokenize = ["-tok", options[1]] if "--tokenize" in options else []
    for metric, name, extra in (("bleu", "BLEU", ["-lc"] * lower + tokenize), ("chrf", "chrF2", ["--chrf-lowercase"] * lower)):
        theirs = sacrebleu_cli(str(hyp), plain_refs, "-m", metric, *extra)
        assert ours[name]["score"] == pytest.approx(theirs["score"], abs=0.05), (metric, ours, theirs)
        assert ours[name]["signature"] == theirs["signature"], (ours[name]["signature"], theirs["signature"])


def test_score_text_output_and_errors(tmp_path, capsys):
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("\n".join(HYPOTHESES) + "\n", encoding="utf-8")
    ref = tmp_path / "ref.txt"
    ref.write_text("\n".join(REFERENCES[0]) + "\n", encoding="utf-8")
    assert main(["score", str(hyp), str(ref), "--metrics", "bleu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:") and "chrF" not in out
    short = tmp_path / "short.txt"
    short.write_text("one line\n", encoding="utf-8")
    assert main(["score", str(hyp), str(short)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-hardattn score: error:") and "has 1 lines" in err and "has 4" in err
    longer = tmp_path / "longer.txt"  # more reference lines than hypotheses is refused too
    longer.write_text("\n".join(REFERENCES[0] + ["extra"]) + "\n", encoding="utf-8")
    assert main(["score", str(hyp), str(longer)]) == 2
    assert "has 5 lines" in capsys.readouterr().err
    assert main(["score", str(tmp_path / "none.txt"), str(ref)]) == 2
    assert "HYP=" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["score", str(hyp), str(ref), "--metrics", "ter"])
