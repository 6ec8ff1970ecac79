"""Decoding speed of every variant against the soft Transformer, transformers.MarianMTModel and (if installed)
CTranslate2, same dimensions, one process.

All models: d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 8000, random weights (no dropout at inference).
30 output tokens are forced, greedy and beam 4, batch 1 and 32, source length 24, 2 threads. The torch models decode
with EOS switched off (``eos_token_id=None``: generate() runs max_new_tokens = 30 steps with no EOS check and no
forced EOS); until 2026-11-27 they were forced by min_new_tokens = 30, whose two min-length logits processors mask
the whole [rows, vocabulary] score tensor at every step, work that no real decode does (6-7% of soft int8 greedy
batch 1 and of hybrid int8 beam 4 batch 32 on the AVX2 EPYC; same tokens either way); CTranslate2 is forced by
min_decoding_length = max_decoding_length = 30, as before. Within one (mode, batch) setting the models run
alternately round by round, and the median per model is reported, so load from other processes hits all of them
alike.

* ``attention_removed``: the soft model whose attention *core* (scores, normalisation, weighted sum) returns a value
  row without looking at any score; projections, caches and everything else are kept. It is the ceiling for any
  change that only replaces the attention function, such as hard retrieval.
* ``marian``: ``transformers.MarianMTModel`` with the same sizes (shared embeddings, no forced EOS).
* ``hc_sa`` / ``sh_x``: the hard-coded Gaussian presets; ``hybrid_*``: 6-layer encoder + 1-layer GRU decoder
  (hidden 1024, the paper's 6-1) with each attention function; ``recurrent_*``: recurrent cross-attention;
  ``beam_joint_k6`` / ``beam_joint_k1``: beam-joint in the last layer, decoded with K=6 / K=1.
* ``soft_bf16`` / ``marian_bf16``: the same two models with bfloat16 weights (this CPU has AMX-BF16).
* ``*_packed``: the same model after ``pack_linears()`` (``hf_hardattn/packed_linear.py``): linear layers multiply
  inputs of up to 128 rows with oneDNN-prepacked weights; MarianMTModel is packed too, for the fair comparison.
* ``soft_expanded`` / ``soft_packed_expanded`` / ``hybrid_dot_expanded``: the same models with the encoder output
  expanded to one row per beam (what transformers does; our models keep one row per sentence, so cross-attention
  keys/values are projected, cached and read once per sentence). Only beam 4 differs.
* ``*_int8``: the same model after ``quantize_int8()`` (torch's dynamic int8 linear layers);
  ``soft_int8`` is the MarianMTModel that CTranslate2 decodes (same seed, same weights), converted to a soft model
  with ``hf_hardattn.tools.convert`` and quantised: the same architecture and weights as ``ct2_int8``.
  ``soft_int8_expanded``: with transformers' one encoder row per beam (the grouped memory's share of the gain).
  ``soft_int8_onednn``: ``soft_int8`` with its int8 layers packed for torch's oneDNN engine instead of fbgemm (what
  torch's own "x86" engine picks on CPUs with VNNI / AMX; ``quantize_int8(engine="onednn")``, its default packs for
  fbgemm everywhere): measured to choose the int8 kernel per CPU (on the AVX2 EPYC 0.58 / 0.69 / 0.45 / 0.85x
  fbgemm's speed, ``decode_speed_int8_engines_epyc_avx2.json``).
* ``ct2_float32`` / ``ct2_int8``: the same MarianMTModel converted with ``ctranslate2`` (what a user would pick for
  fast CPU decoding), ``intra_threads`` = --threads; the reference, not a model of this package. Measured in a
  second process (its OpenMP threads keep spinning after each call and would slow down the next torch model in the
  same process), driven round by round from the first: within each round the ct2 models run after the torch
  models, with a pause of PAUSE_S around them, so load from other processes hits both alike. Its backend is its
  own default for the CPU (oneDNN int8 on AMD; ``CT2_USE_MKL=1`` was 3-4x slower on the AVX2 EPYC), printed with
  ``CT2_VERBOSE=1``.

* ``*_static`` / ``*_compiled``: the same model decoding with ``generate(..., cache_implementation="static")``
  (preallocated keys/values written in place, the shapes of a step fixed), run eagerly / with its decoding steps
  compiled by torch.compile (inductor, ``fullgraph=True``, ``dynamic=True``: the generate() keywords of
  ``hf_hardattn.modeling_hardattn.compiled_decoding``; transformers' own path for ``marian_compiled``, whose beam
  search, transformers 5.24, runs its forward eagerly); ``soft_compiled_frozen``: inductor's freezing too (weights
  constant, prepacked for oneDNN). ``--compile`` adds the ``*_compiled`` row of every named model that has one. The
  first call of every model (its warm-up) is timed too: for a compiled model it holds the compile, on a fresh
  inductor cache (a temporary ``TORCHINDUCTOR_CACHE_DIR``); the compiled rows' tokens are compared with their eager
  model's (fp32: a near tie may part them).

The speed targets: soft >= 1.2x marian; hard_retrieval >= 0.8x attention_removed; hybrid 6-1 >= 4x soft;
sh_x >= 1.3x soft. The int8 targets: soft_int8 >= 1.0x ct2_int8 at every setting and >= 1.3x at batch 1; hybrid_dot_int8
>= 2.5x ct2_int8.

Peak memory (``--memory``): each model is built and decodes once in a fresh process (batch 32, beam 4, the
largest setting); reported: the process's peak resident memory above what it held after importing torch and
transformers (torch models: built in fp32, then quantised or cast, as a user loads them), and the weights' bytes
(int8 layers: int8 weights and their scales; ``ct2_*``: the converted folder, converted with its compute type as
quantization, another process).

    python benchmarks/decode_speed.py                     # full table -> benchmarks/results/decode_speed_KIND.json
    python benchmarks/decode_speed.py --models soft marian --batch-sizes 1 --modes greedy --repeats 3
    python benchmarks/decode_speed.py --models soft marian --compile --repeats 5   # static cache + compiled steps
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn import (BeamJointTransformerConfig, BeamJointTransformerForConditionalGeneration, GaussianConfig,
                         GaussianForConditionalGeneration, HardRetrievalConfig, HardRetrievalForConditionalGeneration,
                         HybridConfig, HybridForConditionalGeneration, RecurrentConfig,
                         RecurrentForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.layers import SoftAttention
from hf_hardattn.modeling_hardattn import compiled_decoding
from hf_hardattn.packed_linear import pack_linears
from hf_hardattn.tools.training import cpu_has_bf16_matmul, machine
from machine_kind import default_output

DIMS = dict(vocab_size=8000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
SOURCE_LENGTH = 24


def removed_attend(q, k, v, mask, causal):
    """No scores, no normalisation, no weighted sum: every query returns the first value row."""
    return v[:, :, :1].expand(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def build_removed():
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS, **SPECIAL))
    for module in model.modules():
        if isinstance(module, SoftAttention):
            module.attend = removed_attend
    return model


def marian_config():
    from transformers import MarianConfig

    return MarianConfig(**DIMS, activation_function="relu", scale_embedding=True,
                        share_encoder_decoder_embeddings=True, forced_eos_token_id=None, max_position_embeddings=512,
                        **SPECIAL)


def build_marian():
    from transformers import MarianMTModel

    return MarianMTModel(marian_config())


def build_hybrid(attention):
    dims = dict(DIMS, decoder_layers=1)
    return lambda: HybridForConditionalGeneration(HybridConfig(**dims, **SPECIAL, rnn_hidden_size=1024,
                                                               rnn_embedding_size=512, rnn_attention=attention))


def build_beam_joint(inference_k):
    return lambda: BeamJointTransformerForConditionalGeneration(
        BeamJointTransformerConfig(**DIMS, **SPECIAL, joint_k=6, joint_inference_k=inference_k))


def build_soft_from_marian():
    """The soft model holding the weights of ``build_marian()`` under seed 0: the MarianMTModel CTranslate2 decodes."""
    from hf_hardattn import convert

    torch.manual_seed(0)
    return convert(build_marian().eval(), "soft_transformer")


def int8(model):
    return model.eval().quantize_int8()


def expanded_memory(model):
    """``model`` decoding with transformers' expansion of the encoder output to one row per beam instead of the
    grouped memory (one row per sentence; ``HardAttnForConditionalGeneration._expand_inputs_for_generation``)."""
    model._memory_grouped_decoding = lambda: False
    return model


def static(model):
    """``model`` decoding with a static cache (eager steps)."""
    model.generation_config.cache_implementation = "static"
    return model


def compiled(model, **options):
    """``model`` decoding with a static cache and compiled steps (:func:`compiled_decoding`'s generate() keywords, set
    on its generation config)."""
    model.generation_config.update(**compiled_decoding(model, **options))
    return model


BUILDERS = {
    "marian": build_marian,
    "soft": lambda: SoftTransformerForConditionalGeneration(SoftTransformerConfig(**DIMS, **SPECIAL)),
    "attention_removed": build_removed,
    "hard_retrieval": lambda: HardRetrievalForConditionalGeneration(HardRetrievalConfig(**DIMS, **SPECIAL)),
    "hc_sa": lambda: GaussianForConditionalGeneration(GaussianConfig.preset("hc-sa", **DIMS, **SPECIAL)),
    "sh_x": lambda: GaussianForConditionalGeneration(GaussianConfig.preset("sh-x", **DIMS, **SPECIAL)),
    "hybrid_additive": build_hybrid("additive"),
    "hybrid_dot": build_hybrid("dot"),
    "hybrid_multihead": build_hybrid("multihead"),
    "recurrent_expand_1": lambda: RecurrentForConditionalGeneration(
        RecurrentConfig(**DIMS, **SPECIAL, recurrent_variant="expand_1")),
    "recurrent_coverage": lambda: RecurrentForConditionalGeneration(
        RecurrentConfig(**DIMS, **SPECIAL, recurrent_variant="coverage")),
    "beam_joint_k6": build_beam_joint(None),
    "beam_joint_k1": build_beam_joint(1),
}
BUILDERS["soft_bf16"] = lambda: BUILDERS["soft"]().to(torch.bfloat16)
BUILDERS["marian_bf16"] = lambda: build_marian().to(torch.bfloat16)
for _name in ("soft", "marian", "hard_retrieval", "attention_removed", "sh_x", "hybrid_dot"):  # oneDNN-prepacked
    BUILDERS[f"{_name}_packed"] = lambda _name=_name: pack_linears(BUILDERS[_name]())  # linears (packed_linear.py)
for _name in ("soft", "soft_packed", "hybrid_dot"):  # encoder output expanded to one row per beam, as in transformers
    BUILDERS[f"{_name}_expanded"] = lambda _name=_name: expanded_memory(BUILDERS[_name]())
BUILDERS["soft_int8"] = lambda: int8(build_soft_from_marian())  # ct2_int8's weights
BUILDERS["soft_int8_onednn"] = lambda: build_soft_from_marian().eval().quantize_int8(engine="onednn")
for _name in ("hard_retrieval", "sh_x", "hybrid_dot", "recurrent_expand_1", "beam_joint_k6"):
    BUILDERS[f"{_name}_int8"] = lambda _name=_name: int8(BUILDERS[_name]())
BUILDERS["soft_int8_expanded"] = lambda: expanded_memory(BUILDERS["soft_int8"]())
for _name in ("soft", "hard_retrieval", "marian", "attention_removed", "hc_sa", "sh_x", "hybrid_dot",
              "recurrent_expand_1", "beam_joint_k6"):  # static cache (eager and compiled steps)
    BUILDERS[f"{_name}_static"] = lambda _name=_name: static(BUILDERS[_name]())
    BUILDERS[f"{_name}_compiled"] = lambda _name=_name: compiled(BUILDERS[_name]())
for _name in ("soft", "hard_retrieval", "attention_removed", "sh_x", "hybrid_dot"):  # + inductor's freezing
    BUILDERS[f"{_name}_compiled_frozen"] = lambda _name=_name: compiled(BUILDERS[_name](), options={"freezing": True})
    # oneDNN-prepacked linears (their kernel an opaque operator in the graph) + compiled steps
    BUILDERS[f"{_name}_packed_compiled"] = lambda _name=_name: compiled(pack_linears(BUILDERS[_name]()))
CT2 = ("ct2_float32", "ct2_int8")
RATIOS = [  # label, numerator, denominator
    ("soft_static / soft", "soft_static", "soft"),
    ("soft_compiled / soft", "soft_compiled", "soft"),
    ("soft_compiled_frozen / soft", "soft_compiled_frozen", "soft"),
    ("soft_compiled / marian_compiled", "soft_compiled", "marian_compiled"),
    ("marian_compiled / marian", "marian_compiled", "marian"),
    ("hard_retrieval_compiled / soft_compiled", "hard_retrieval_compiled", "soft_compiled"),
    ("soft_compiled_frozen / soft_packed", "soft_compiled_frozen", "soft_packed"),
    ("soft_packed_compiled / soft", "soft_packed_compiled", "soft"),
    ("soft_packed_compiled / soft_packed", "soft_packed_compiled", "soft_packed"),
    ("soft_packed_compiled / marian_compiled", "soft_packed_compiled", "marian_compiled"),
    ("hard_retrieval_packed_compiled / soft_packed_compiled", "hard_retrieval_packed_compiled", "soft_packed_compiled"),
    ("hard_retrieval_packed_compiled / attention_removed_packed_compiled", "hard_retrieval_packed_compiled",
     "attention_removed_packed_compiled"),
    ("sh_x_packed_compiled / soft_packed_compiled", "sh_x_packed_compiled", "soft_packed_compiled"),
    ("hybrid_dot_packed_compiled / soft_packed_compiled", "hybrid_dot_packed_compiled", "soft_packed_compiled"),
    ("soft_compiled_frozen / marian_compiled", "soft_compiled_frozen", "marian_compiled"),
    ("hard_retrieval_compiled_frozen / soft_compiled_frozen", "hard_retrieval_compiled_frozen", "soft_compiled_frozen"),
    ("hard_retrieval_compiled_frozen / attention_removed_compiled_frozen", "hard_retrieval_compiled_frozen",
     "attention_removed_compiled_frozen"),
    ("sh_x_compiled_frozen / soft_compiled_frozen", "sh_x_compiled_frozen", "soft_compiled_frozen"),
    ("hybrid_dot_compiled_frozen / soft_compiled_frozen", "hybrid_dot_compiled_frozen", "soft_compiled_frozen"),
    ("hc_sa_compiled / soft_compiled", "hc_sa_compiled", "soft_compiled"),
    ("recurrent_expand_1_compiled / soft_compiled", "recurrent_expand_1_compiled", "soft_compiled"),
    ("beam_joint_k6_compiled / soft_compiled", "beam_joint_k6_compiled", "soft_compiled"),
    ("soft / marian", "soft", "marian"),
    ("hard_retrieval / attention_removed", "hard_retrieval", "attention_removed"),
    ("hard_retrieval / soft", "hard_retrieval", "soft"),
    ("hybrid_additive / soft", "hybrid_additive", "soft"),
    ("hybrid_dot / soft", "hybrid_dot", "soft"),
    ("sh_x / soft", "sh_x", "soft"),
    ("hc_sa / soft", "hc_sa", "soft"),
    ("soft_bf16 / marian_bf16", "soft_bf16", "marian_bf16"),
    ("soft_bf16 / soft", "soft_bf16", "soft"),
    ("ct2_float32 / soft", "ct2_float32", "soft"),
    ("ct2_int8 / soft", "ct2_int8", "soft"),
    ("soft / soft_expanded", "soft", "soft_expanded"),
    ("soft_packed / soft_packed_expanded", "soft_packed", "soft_packed_expanded"),
    ("hybrid_dot / hybrid_dot_expanded", "hybrid_dot", "hybrid_dot_expanded"),
    ("soft_packed / soft", "soft_packed", "soft"),
    ("soft_packed / marian", "soft_packed", "marian"),
    ("soft_packed / marian_packed", "soft_packed", "marian_packed"),
    ("hard_retrieval_packed / attention_removed_packed", "hard_retrieval_packed", "attention_removed_packed"),
    ("hybrid_dot_packed / soft_packed", "hybrid_dot_packed", "soft_packed"),
    ("sh_x_packed / soft_packed", "sh_x_packed", "soft_packed"),
    ("soft_int8 / ct2_int8", "soft_int8", "ct2_int8"),
    ("soft_int8_onednn / ct2_int8", "soft_int8_onednn", "ct2_int8"),
    ("soft_int8_onednn / soft_int8", "soft_int8_onednn", "soft_int8"),
    ("hard_retrieval_int8 / ct2_int8", "hard_retrieval_int8", "ct2_int8"),
    ("sh_x_int8 / ct2_int8", "sh_x_int8", "ct2_int8"),
    ("hybrid_dot_int8 / ct2_int8", "hybrid_dot_int8", "ct2_int8"),
    ("hybrid_dot_packed / ct2_int8", "hybrid_dot_packed", "ct2_int8"),
    ("soft_packed / ct2_int8", "soft_packed", "ct2_int8"),
    ("soft_int8 / soft_packed", "soft_int8", "soft_packed"),
    ("soft_bf16 / soft_packed", "soft_bf16", "soft_packed"),
    ("soft_int8 / soft_int8_expanded", "soft_int8", "soft_int8_expanded"),
    ("hard_retrieval_int8 / soft_int8", "hard_retrieval_int8", "soft_int8"),
    ("sh_x_int8 / soft_int8", "sh_x_int8", "soft_int8"),
    ("hybrid_dot_int8 / soft_int8", "hybrid_dot_int8", "soft_int8"),
    ("recurrent_expand_1_int8 / soft_int8", "recurrent_expand_1_int8", "soft_int8"),
    ("beam_joint_k6_int8 / soft_int8", "beam_joint_k6_int8", "soft_int8"),
]

# int8 with compiled steps, on ct2_int8's weights: soft_int8_compiled (the fbgemm layers, their kernel called through
# packed_linear.INT8_LINEAR_OP in the compiled step); soft_int8_traced: quantize_int8(engine="traced") (int8 layers in
# torch operators, hf_hardattn/int8_traced.py) eagerly, and soft_int8_traced_compiled with compiled steps (its tokens
# are compared with soft_int8_traced's)
BUILDERS["soft_int8_compiled"] = lambda: compiled(BUILDERS["soft_int8"]())
BUILDERS["soft_int8_traced"] = lambda: build_soft_from_marian().eval().quantize_int8(engine="traced")
BUILDERS["soft_int8_traced_compiled"] = lambda: compiled(BUILDERS["soft_int8_traced"]())
RATIOS += [("soft_int8_compiled / ct2_int8", "soft_int8_compiled", "ct2_int8"),
           ("soft_int8_compiled / soft_int8", "soft_int8_compiled", "soft_int8"),
           ("soft_int8_traced_compiled / ct2_int8", "soft_int8_traced_compiled", "ct2_int8"),
           ("soft_int8_traced_compiled / soft_int8", "soft_int8_traced_compiled", "soft_int8"),
           ("soft_int8_traced / soft_int8", "soft_int8_traced", "soft_int8")]
# the mechanisms in int8 with compiled steps (traced engine), against soft_int8_traced_compiled (the same sizes): with
# the weight matrices a quarter of fp32's bytes, a step's attention core is a larger share of it than in fp32
for _name in ("hard_retrieval", "attention_removed", "hybrid_dot"):
    BUILDERS[f"{_name}_int8_traced"] = lambda _name=_name: BUILDERS[_name]().eval().quantize_int8(engine="traced")
    BUILDERS[f"{_name}_int8_traced_compiled"] = lambda _name=_name: compiled(BUILDERS[f"{_name}_int8_traced"]())
    RATIOS.append((f"{_name}_int8_traced_compiled / soft_int8_traced_compiled", f"{_name}_int8_traced_compiled",
                   "soft_int8_traced_compiled"))
RATIOS += [("hard_retrieval_int8_traced_compiled / attention_removed_int8_traced_compiled",
            "hard_retrieval_int8_traced_compiled", "attention_removed_int8_traced_compiled")]


def ctranslate2_available():
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


class CT2Model:
    """The MarianMTModel converted with ctranslate2, decoding the same token ids (as vocabulary strings)."""

    def __init__(self, marian, compute_type, threads, folder, quantization=None):
        import ctranslate2
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        path = os.path.join(folder, "marian")
        if not os.path.isdir(os.path.join(folder, "ct2")):
            # ctranslate2's Marian loader drops the last vocabulary entry when it is "<pad>" (transformers' Marian
            # appends it), so the last id is named so; the random source ids below never use it.
            vocab = {"<blank>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
            vocab.update({f"w{i}": i for i in range(4, DIMS["vocab_size"] - 1)})
            vocab["<pad>"] = DIMS["vocab_size"] - 1
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
            marian.save_pretrained(path)
            tokenizer.save_pretrained(path)
            ctranslate2.converters.TransformersConverter(path).convert(os.path.join(folder, "ct2"), force=True,
                                                                       quantization=quantization)
        self.folder = os.path.join(folder, "ct2")
        self.translator = ctranslate2.Translator(os.path.join(folder, "ct2"), device="cpu", compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=1)

    def generate(self, input_ids, num_beams, new_tokens):
        last = DIMS["vocab_size"] - 2
        tokens = [[f"w{min(i, last)}" if i > 3 else "</s>" for i in row.tolist()] for row in input_ids]
        out = self.translator.translate_batch(tokens, beam_size=num_beams, min_decoding_length=new_tokens,
                                              max_decoding_length=new_tokens, max_batch_size=len(tokens))
        assert all(len(r.hypotheses[0]) >= new_tokens - 1 for r in out), [len(r.hypotheses[0]) for r in out]
        return out


def make_inputs(batch_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, DIMS["vocab_size"], (batch_size, SOURCE_LENGTH), generator=generator)
    ids[:, -1] = SPECIAL["eos_token_id"]
    return ids, torch.ones_like(ids)


def run_once(model, ids, mask, num_beams, new_tokens):
    if isinstance(model, CT2Model):
        return model.generate(ids, num_beams, new_tokens)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None,
                             num_beams=num_beams, do_sample=False, use_cache=True)
    assert out.shape[1] == new_tokens + 1, out.shape
    return out


PAUSE_S = 0.5  # between torch's and ctranslate2's calls: both OpenMP runtimes spin a while after a call


class CT2Process:
    """The ct2_* models in a process of their own (ctranslate2's OpenMP threads keep spinning after each call and
    would slow down the torch model timed next in the same process), driven from this one round by round, so that
    they alternate with the torch models in time and load from other processes hits both alike."""

    def __init__(self, names, threads):
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ct2-serve", "--models", *names,
                                         "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self._answer()  # converted and loaded

    def _answer(self):
        for line in self.process.stdout:
            if line.startswith("CT2 "):
                return json.loads(line[4:])
        raise RuntimeError(f"the ctranslate2 process ended (exit code {self.process.wait()})")

    def times(self, batch_size, num_beams, new_tokens):
        """Seconds of one call of each ct2 model on ``make_inputs(batch_size)``."""
        self.process.stdin.write(json.dumps([batch_size, num_beams, new_tokens]) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def ct2_serve(names, threads):
    """The other end of :class:`CT2Process`: one line [batch size, beams, new tokens] in, one line of times out."""
    import sys

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        marian = build_marian().eval()
        ct2 = {name: CT2Model(marian, name.split("_")[1], threads, folder) for name in names}
        print("CT2 {}", flush=True)
        for line in sys.stdin:
            batch_size, num_beams, new_tokens = json.loads(line)
            ids, mask = make_inputs(batch_size)
            times = {}
            for name, model in ct2.items():
                start = time.perf_counter()
                run_once(model, ids, mask, num_beams, new_tokens)
                times[name] = time.perf_counter() - start
            print("CT2 " + json.dumps(times), flush=True)


def measure(models, ids, mask, num_beams, new_tokens, repeats, ct2=None, first_calls=None):
    """(sentences/s per model: batch size / median time, the times of every round); models alternate within each
    round (the ct2_* models of ``ct2``, a :class:`CT2Process`, too: after the torch models, with a pause around
    them). ``first_calls``: a dict that gets each torch model's warm-up (first call) seconds and tokens."""
    times = {name: [] for name in models}
    for name, model in models.items():
        start = time.perf_counter()
        out = run_once(model, ids, mask, num_beams, new_tokens)  # warm-up
        if first_calls is not None:
            first_calls[name] = (time.perf_counter() - start, out)
    if ct2 is not None:
        time.sleep(PAUSE_S)
        times.update({name: [] for name in ct2.times(ids.shape[0], num_beams, new_tokens)})  # warm-up
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            run_once(model, ids, mask, num_beams, new_tokens)
            times[name].append(time.perf_counter() - start)
        if ct2 is not None:
            time.sleep(PAUSE_S)
            for name, seconds in ct2.times(ids.shape[0], num_beams, new_tokens).items():
                times[name].append(seconds)
            time.sleep(PAUSE_S)
    return {name: ids.shape[0] / statistics.median(t) for name, t in times.items()}, times


def compiled_costs(first_calls, times, batch_size):
    """For every ``X_compiled*`` model beside its eager ``X``: its first call (the compile, and one decode), the
    compile's cost above its median call, the sentences after which that cost is earned back (the compile time over
    the time the compiled decode saves per sentence against X's; None when it saves none) and the share of token
    positions equal to X's (the same weights, fp32)."""
    costs = {}
    for name, (first, out) in first_calls.items():
        eager = name.split("_compiled")[0] if "_compiled" in name else None
        if eager not in first_calls:
            continue
        compile_s = first - statistics.median(times[name])
        saved = (statistics.median(times[eager]) - statistics.median(times[name])) / batch_size
        costs[name] = {"eager": eager, "first_call_s": first, "compile_s": compile_s,
                       "sentences_to_earn_back": max(0, round(compile_s / saved)) if saved > 0 else None,
                       "tokens_equal": float((out == first_calls[eager][1]).float().mean())}
    return {"compile": costs}


def weight_bytes(model):
    """Bytes of the weights as stored (``torch.save`` of the state dict: int8 layers hold int8 weights and scales)."""
    import io

    if isinstance(model, CT2Model):
        return sum(os.path.getsize(os.path.join(model.folder, f)) for f in os.listdir(model.folder))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def memory_worker(name, threads):
    """Peak resident memory of building ``name`` and decoding batch 32 with beam 4 once, above the process's peak
    after its imports (ru_maxrss: a peak, so the import's transient memory is in the baseline), and its weights."""
    import resource

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        if name in CT2:  # converted (weights stored in the compute type) by another process: not in the peak here
            import subprocess
            import sys

            subprocess.run([sys.executable, os.path.abspath(__file__), "--ct2-convert", folder, "--models", name],
                           check=True, capture_output=True)
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        torch.manual_seed(0)
        if name in CT2:
            model = CT2Model(None, name.split("_")[1], threads, folder)
        else:
            model = BUILDERS[name]().eval()
        run_once(model, *make_inputs(32), 4, 30)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_mib": (peak - baseline) / 1024, "weights_mib": weight_bytes(model) / 2**20}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = list(BUILDERS) + list(CT2)
    parser.add_argument("--models", nargs="+", default=None, choices=choices,
                        help="default: all (ct2_* only when ctranslate2 is installed, *_bf16 only on CPUs with "
                             "native bf16 matrix products)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--modes", nargs="+", default=["greedy", "beam4"], choices=["greedy", "beam4"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=default_output("decode_speed"))
    parser.add_argument("--compile", action="store_true",
                        help="also the *_compiled row (static cache, compiled steps) of every named model that has one")
    parser.add_argument("--memory", action="store_true",
                        help="instead of speed: peak memory and weight size of each model, each in a fresh process")
    parser.add_argument("--ct2-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    parser.add_argument("--ct2-convert", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ct2_convert:
        torch.manual_seed(0)
        compute_type = args.models[0].split("_")[1]
        CT2Model(build_marian().eval(), compute_type, 1, args.ct2_convert, quantization=compute_type)
        return None
    if args.memory_worker:
        print("MEMRESULT" + json.dumps(memory_worker(args.memory_worker, args.threads)))
        return None
    names = args.models or list(BUILDERS) + (list(CT2) if ctranslate2_available() else [])
    if not args.models and not cpu_has_bf16_matmul():  # bf16 GEMMs run ~100x slower than fp32 on such a CPU
        names = [n for n in names if not n.endswith("_bf16")]
        print("skipping the *_bf16 models: this CPU has no native bf16 matrix products (name them to run them)")
    if args.compile:
        names += [f"{n}_compiled" for n in names if f"{n}_compiled" in BUILDERS and f"{n}_compiled" not in names]
    if any(n.endswith(("_compiled", "_compiled_frozen")) for n in names):  # compile times on a fresh inductor cache
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="decode_speed_inductor_"))
    if any(n in CT2 for n in names) and not ctranslate2_available():
        parser.error("ct2_* models need `pip install ctranslate2`")
    if args.memory:
        return memory_table(names, args)
    torch.set_num_threads(args.threads)
    settings = [(mode, batch_size) for mode in args.modes for batch_size in args.batch_sizes]
    if args.ct2_serve:
        return ct2_serve(names, args.threads)
    models = {}
    for name in names:
        if name not in CT2:
            torch.manual_seed(0)
            models[name] = BUILDERS[name]().eval()
    ct2_names = [name for name in names if name in CT2]
    ct2 = CT2Process(ct2_names, args.threads) if ct2_names else None
    rows = []
    try:
        for mode, batch_size in settings:
            ids, mask = make_inputs(batch_size)
            first_calls = {}
            speeds, times = measure(models, ids, mask, 4 if mode == "beam4" else 1, args.new_tokens, args.repeats,
                                    ct2, first_calls)
            rows.append({"mode": mode, "batch_size": batch_size, "sentences_per_s": speeds, "seconds_per_round": times,
                         **compiled_costs(first_calls, times, batch_size)})
            print(f"{mode:6s} batch {batch_size:3d}: " + ", ".join(f"{n} {s:.2f}" for n, s in speeds.items()),
                  flush=True)
            for name, cost in rows[-1]["compile"].items():
                print(f"    {name}: first call {cost['first_call_s']:.1f} s, {cost['compile_s']:.1f} s above a "
                      f"timed call; earned back after {cost['sentences_to_earn_back']} sentences; tokens equal to "
                      f"{cost['eager']}'s in {cost['tokens_equal']:.1%} of positions", flush=True)
    finally:
        if ct2 is not None:
            ct2.close()
    models.update({name: None for name in ct2_names})
    ratios = [r for r in RATIOS if r[1] in models and r[2] in models]
    speed_lines = ["| model | " + " | ".join(f"{r['mode']} b{r['batch_size']}" for r in rows) + " |",
                   "| --- |" + " ---: |" * len(rows)]
    for name in models:
        speed_lines.append(f"| {name} | " + " | ".join(f"{r['sentences_per_s'][name]:.2f}" for r in rows) + " |")
    ratio_lines = ["| ratio | " + " | ".join(f"{r['mode']} b{r['batch_size']}" for r in rows) + " |",
                   "| --- |" + " ---: |" * len(rows)]
    for label, a, b in ratios:
        cells = [r["sentences_per_s"][a] / r["sentences_per_s"][b] for r in rows]
        for r, value in zip(rows, cells):
            r.setdefault("ratios", {})[label] = value
        ratio_lines.append(f"| {label} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")
    table = "sentences/s:\n\n" + "\n".join(speed_lines) + "\n\nratios:\n\n" + "\n".join(ratio_lines)
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump({"machine": machine(), "settings": {**DIMS, "new_tokens": args.new_tokens, "threads": args.threads,
                                "repeats": args.repeats, "source_length": SOURCE_LENGTH, "seed": 0,
                                "precision": "float32 unless the model's name says bf16 or int8"},
                   "rows": rows, "table": table}, handle, indent=2)
    return rows


def memory_table(names, args):
    import subprocess
    import sys

    results = {}
    for name in names:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-worker", name, "--threads",
                              str(args.threads)], capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.split("MEMRESULT", 1)[1])
        print(f"{name}: peak {results[name]['peak_mib']:.0f} MiB, weights {results[name]['weights_mib']:.1f} MiB",
              flush=True)
    lines = ["| model | peak memory, MiB (build + beam 4, batch 32) | weights, MiB |", "| --- | ---: | ---: |"]
    lines += [f"| {n} | {r['peak_mib']:.0f} | {r['weights_mib']:.1f} |" for n, r in results.items()]
    table = "\n".join(lines)
    print(table)
    output = args.output.replace(".json", "_memory.json") if args.output.endswith(".json") else args.output
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as handle:
        json.dump({"machine": machine(), "settings": {**DIMS, "threads": args.threads, "source_length": SOURCE_LENGTH},
                   "models": results, "table": table}, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
