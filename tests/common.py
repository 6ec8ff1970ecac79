"""Shared checks every hf_hardattn variant must pass (tiny configs, offline).

Each variant's test module calls these with its own model factory, so the HF-integration contract (cache ==
no-cache, padded batch == single, save/load, remote code in a fresh process, Trainer) is tested the same way
for all of them.
"""

import copy
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import TrainerCallback

from hf_hardattn.model_card import MIN_TRANSFORMERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 40
PAD, BOS, EOS = 0, 1, 2


def tiny_kwargs(**overrides):
    """Sizes for fast tests; all special tokens inside the vocabulary. Embeddings N(0, d^-1/2) (``embed_init_std``
    None) for every type: the tests' toy tasks and random-model checks were written against that init, and on such
    small character-like tasks it is the better one; the types' own defaults are tested in test_skeleton."""
    kwargs = dict(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
        embed_init_std=None,
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


def decoding_batch(extra=6, seed=2):
    """`source_batch()` and ``extra`` sentences of the reversal task (`copy_task`), right-padded (8 sentences by
    default): enough decisions for an fp32 comparison to find many clear of rounding
    (`assert_same_tokens_where_margins_allow`)."""
    ids, _ = source_batch()
    rows = [row[row != PAD].tolist() for row in ids] + [r["input_ids"] for r in copy_task(extra, seed=seed)]
    width = max(map(len, rows))
    ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
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


def memorise(model, batch, margins, minimum, max_steps, learning_rate=3e-3):
    """Adam on one fixed batch until ``margins(model)`` (each target token's logit minus the best other one) is at
    least ``minimum`` everywhere, checked every 10 steps; returns the number of steps taken (the caller asserts the
    margins, with its own message, and casts the model)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    for step in range(max_steps):
        if step % 10 == 0 and margins(model).min() >= minimum:
            return step
        model.train()
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return max_steps


MIN_DISTINCT_TOKENS = 4


def is_nontrivial(tokens):
    return len(torch.unique(tokens)) >= MIN_DISTINCT_TOKENS


def assert_nontrivial(tokens):
    """Guards the equivalence checks: outputs that repeat one token could hide a bug (`fitted` aims above it)."""
    assert is_nontrivial(tokens), f"degenerate output, the check could not fail: {tokens.tolist()}"


def as_float64(model):
    """A float64 copy of ``model`` (the caller's model is left as it is). Two code paths that compute the same function
    in float64 differ by about 1e-15 of the values, so an exact-token comparison between them cannot be flipped by
    rounding (an fp32 argmax or sampling draw can: a last-bit difference decides a near tie)."""
    return copy.deepcopy(model).double().eval()


def assert_step_scores_close(got, expected, what=""):
    """generate()'s step scores of two code paths of a float64 model: generate() casts the logits to fp32, so values
    ~1e-15 apart may round to neighbouring fp32 numbers (and log_softmax adds a few fp32 roundings): equal within 8 fp32
    ulps of the step's largest |score|, -inf at the same places."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], expected[~finite]), what
    scale = float(expected[finite].abs().max()) if finite.any() else 0.0
    gap = float((got - expected)[finite].abs().max()) if finite.any() else 0.0
    assert gap <= 8 * torch.finfo(torch.float32).eps * max(scale, 1.0), f"{what}: scores differ by {gap:.3g}"


def check_cache_equivalence(model):
    """Cached and uncached decoding give the same tokens (greedy, beam, sampling), in float64 (see `as_float64`)."""
    model = as_float64(model)
    for mode in ("greedy", "beam", "sample"):
        cached, uncached = run_generate(model, mode, True), run_generate(model, mode, False)
        assert_nontrivial(cached)
        assert torch.equal(cached, uncached), f"{mode}: cache {cached.tolist()} != no cache {uncached.tolist()}"


# -- exact tokens between two fp32 code paths (what float64 cannot cover: packed linears, another process) ----------
RHO_MAX = 4.0
FP32_PATHS_RTOL = 3.1e-5
"""Bound on how far the logits of two fp32 code paths that compute the same function (another GEMM kernel, another
thread count, another process) may part, relative to the step's largest |logit| M: twice the error one path may make
against exact arithmetic (triangle inequality), which splits in two terms at the output layer, logits = W h:
- the output GEMM: an fp32 dot product of length K errs by at most K * 2**-24 * sum_k |h_k||w_ik| whatever its
  summation order; with rho = max_i sum_k |h_k||w_ik| / M <= RHO_MAX (`output_layer_rho`: 1.5-3.2 over the contract,
  packed-test and converted N(0, 0.5) models; asserted by `check_remote_code` and the packed tests) and K = 32 that is
  32 * 2**-24 * 4 = 7.6e-6 of M;
- the layers before reach the logits as W dh (dh: the error of h). The worst case over signs, sum_k |w_ik||dh_k|, is
  no bound worth having (the error of h is 9-450 u of |h|, weighted by |W|, on these models: it would allow 1e-4 of
  M); the premise is the other term's size, |W dh| <= 7.6e-6 M ("twice that"), and it is asserted where it is used,
  on the path the process runs: `fp32_path_error` (this path's logits against float64 ones of the same weights, both
  terms together, at most FP32_PATHS_RTOL / 2) by the packed tests for the packed and the plain path, on every CPU
  kind and under each pass of .ci/run (MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=SSE41, ATEN_CPU_CAPABILITY=avx2).
Adding the last rounding of a bias (u M): 2 * (7.6e-6 + 7.6e-6 + 6e-8) = 3.06e-5 <= 3.1e-5.
Measured (`fp32_path_error` / (FP32_PATHS_RTOL / 2)): 0.03-0.07 on the packed-test models, 0.51 on its MarianMTModel;
test_convert's N(0, 0.5) sources reach 1.19 (bart), so that file compares logits in float64. The bound is checked on
every compared step (`assert_same_tokens_where_margins_allow`), so rounding beyond it fails loudly."""


def fp32_path_error(model, ids=None, mask=None):
    """The error of ``model``'s fp32 path against exact arithmetic (a float64 copy of the same weights), as the largest
    over positions of max_i |logit_i - exact_i| / max_i |exact_i|: teacher-forced on ``ids`` (`decoding_batch()` by
    default) with its first 5 tokens as decoder inputs. FP32_PATHS_RTOL assumes at most half of it per path."""
    if ids is None:
        ids, mask = decoding_batch()
    decoder_ids = ids[:, :5].clone()
    decoder_ids[:, 0] = model.config.decoder_start_token_id
    decoder_ids[decoder_ids == PAD] = EOS + 2  # (no padding inside decoder inputs)
    with torch.no_grad():
        exact = as_float64(model)(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    assert got.dtype == torch.float32, got.dtype
    return float(((got.double() - exact).abs().amax(-1) / exact.abs().amax(-1)).max())


def assert_fp32_path_premise(model):
    """FP32_PATHS_RTOL's second premise on the path this process runs; the error must be nonzero (so the bound is
    exercised: fp32 differs from float64 on every CPU even where two fp32 paths agree bit for bit)."""
    error = fp32_path_error(model)
    assert 0 < error <= FP32_PATHS_RTOL / 2, (f"fp32 logits part from float64 by {error:.3g} of max|logit|, allowed "
                                              f"(0, {FP32_PATHS_RTOL / 2:.3g}]: FP32_PATHS_RTOL does not cover it")


def output_layer_rho(model, num_beams=4):
    """FP32_PATHS_RTOL's premise for ``model``: max over the positions of its float64 beam output on
    `decoding_batch()` of max_i sum_k |h_k||w_ik| / max_i |logit_i| (h the input of ``lm_head``). None where the
    output layer is not called as a module (beam-joint's mixture multiplies by its weight)."""
    model64 = as_float64(model)
    ids, mask = decoding_batch()
    sequences = model64.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                                 num_beams=num_beams, num_return_sequences=num_beams)
    inputs = []
    hook = model64.lm_head.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad():
        logits = model64(input_ids=ids.repeat_interleave(num_beams, 0), attention_mask=mask.repeat_interleave(
            num_beams, 0), decoder_input_ids=sequences[:, :-1]).logits
        hook.remove()
        if not inputs or inputs[-1].shape[:-1] != logits.shape[:-1]:
            return None
        sums = inputs[-1].abs() @ model64.lm_head.weight.abs().T
        return float((sums.amax(-1) / logits.abs().amax(-1)).max())


def assert_output_layer_premise(model):
    rho = output_layer_rho(model)
    assert rho is None or rho <= RHO_MAX, f"output layer rho {rho:.3g} > {RHO_MAX}: FP32_PATHS_RTOL does not cover it"


class StepRecorder:
    """A logits processor (last in the list) that keeps, for every decoding step, the running sequences it was given
    and the scores generate() decides on (greedy: the processed logits; beam search: processed log-probabilities)."""

    def __init__(self):
        self.ids, self.scores = [], []

    def __call__(self, input_ids, scores):
        self.ids.append(input_ids.clone())
        self.scores.append(scores.detach().clone())
        return scores


def recorded_generate(model, **kwargs):
    """generate() and what it decided on: {"sequences", "ids", "scores", "logits"} (per step: the running sequences,
    the scores of `StepRecorder`, the raw logits)."""
    from transformers import LogitsProcessorList

    recorder = StepRecorder()
    with torch.no_grad():
        out = model.generate(**kwargs, logits_processor=LogitsProcessorList([recorder]), output_logits=True,
                             return_dict_in_generate=True)
    return {"sequences": out.sequences, "ids": recorder.ids, "scores": recorder.scores,
            "logits": [step.detach().float() for step in out.logits]}


def record_from_json(record):
    """A `recorded_generate` record sent as JSON lists (``-Infinity`` included) back to tensors."""
    return {"sequences": torch.tensor(record["sequences"]),
            **{key: [torch.tensor(x) for x in record[key]] for key in ("ids", "scores", "logits")}}


def clear_steps(reference, num_beams=1, rtol=FP32_PATHS_RTOL):
    """Per sentence, the number of leading decoding steps whose decision no rounding within the bound can change; and
    per step, the bound on each score's change. A step's logits of two fp32 paths differ by at most d_t = rtol *
    max|logits_t|. Greedy decides on logits: the argmax holds while top-1 minus top-2 > 2 d_t. Beam search ranks
    accumulated log-probabilities (a step's log-probability moves by at most 2 d_t: log_softmax adds a shift within
    d_t); the beams kept and their order hold while each gap between consecutive ones among the best num_beams + 1
    candidates exceeds twice the bound of what the two do not share, sum 2 d_s over the steps s from the one where
    their paths part to this one. That assumes forced length (min_new_tokens == max_new_tokens): no beam ends early,
    so generate() continues (and at the last step finishes) exactly its best num_beams candidates."""
    scores = reference["scores"]
    steps, rows, vocab = len(scores), scores[0].shape[0], scores[0].shape[1]
    sentences = rows // num_beams
    bounds = [(1 if num_beams == 1 else 2) * rtol * float(step[torch.isfinite(step)].abs().max())
              for step in reference["logits"]]
    clear, cumulative = [steps] * sentences, {}
    for t, step in enumerate(scores):
        ids, step = reference["ids"][t].tolist(), step.double()
        if num_beams > 1:  # + each running beam's accumulated log-probability (first step: beam 0 alone, as generate())
            step = step + torch.tensor([(0.0 if r % num_beams == 0 else -1e9) if t == 0 else
                                        cumulative[r // num_beams, tuple(ids[r])] for r in range(rows)],
                                       dtype=torch.float64)[:, None]
        top, index = step.view(sentences, -1).topk(num_beams + 1, -1)
        for b in range(sentences):
            paths = [tuple(ids[b * num_beams + i // vocab]) + (i % vocab,) for i in index[b].tolist()]
            for i in range(num_beams):
                parted = next((p - 1 for p in range(1, t + 2) if paths[i][p] != paths[i + 1][p]), t)  # a step
                if clear[b] == steps and not top[b, i] - top[b, i + 1] > 2 * sum(bounds[parted : t + 1]):
                    clear[b] = t
            for value, path in zip(top[b, :num_beams].tolist(), paths):
                cumulative[b, path] = value
    return clear, bounds


def assert_same_tokens_where_margins_allow(reference, other, num_beams=1, min_steps=40, rtol=FP32_PATHS_RTOL):
    """Two fp32 code paths decode alike: `recorded_generate` records of the same model and inputs. For each sentence,
    up to its first step whose decision a rounding within the bound could change (`clear_steps`): the same running
    sequences and step scores within the bound (which checks the bound itself); where every step was clear, the same
    returned sequences. At least ``min_steps`` decisions (steps x sentences) must have been compared, or the check
    could pass on near ties alone."""
    clear, bounds = clear_steps(reference, num_beams, rtol)
    returned = reference["sequences"].shape[0] // len(clear)
    assert other["sequences"].shape == reference["sequences"].shape and len(other["scores"]) == len(bounds)
    for b, n in enumerate(clear):
        rows = slice(b * num_beams, (b + 1) * num_beams)
        for t in range(min(n + 1, len(bounds))):  # the steps whose input both paths share
            ref_ids, got_ids = reference["ids"][t][rows], other["ids"][t][rows]
            assert torch.equal(got_ids, ref_ids), f"sentence {b}, step {t}: {got_ids.tolist()} != {ref_ids.tolist()}"
            ref, got = reference["scores"][t][rows], other["scores"][t][rows]
            assert torch.equal(torch.isfinite(ref), torch.isfinite(got))
            gap = float((ref - got)[torch.isfinite(ref)].abs().max())
            assert gap <= bounds[t], f"sentence {b}, step {t}: scores differ by {gap:.3g} > the bound {bounds[t]:.3g}"
        if n == len(bounds):
            ref, got = (r["sequences"][b * returned : (b + 1) * returned] for r in (reference, other))
            assert torch.equal(got, ref), f"sentence {b}: {got.tolist()} != {ref.tolist()}"
    assert sum(clear) >= min_steps, f"only {sum(clear)} decisions clear of rounding (per sentence: {clear}); " \
                                    f"the comparison needs {min_steps}"


GROUPED_MODES = {  # generate() settings that repeat each sentence: beams, returned sequences, both
    "beam": dict(num_beams=4, num_return_sequences=2),
    "sample": dict(do_sample=True, top_k=0, num_return_sequences=3),
    "beam_sample": dict(do_sample=True, num_beams=3, num_return_sequences=3),
}


def check_grouped_memory(model, mode):
    """generate() leaves the encoder output at one row per sentence (grouped memory: source keys/values projected and
    cached once per sentence); the reference is the same model on transformers' expansion to one row per beam.
    Tokens equal, step scores as `assert_step_scores_close`, and the cached source keys have one row per sentence (per
    beam on the reference path). Both in float64 (see `as_float64`)."""
    from hf_hardattn.caches import CACHE_FIELD

    assert model._memory_grouped_decoding()
    model = as_float64(model)
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
    for t, (a, b) in enumerate(zip(grouped.scores, reference.scores, strict=True)):
        assert_step_scores_close(a, b, f"step {t}")
    expand = max(GROUPED_MODES[mode].get("num_beams", 1), GROUPED_MODES[mode]["num_return_sequences"])
    rows = {key: {layer.keys.shape[0] for layer in getattr(out, CACHE_FIELD).cross_attention_cache.layers
                  if layer.is_initialized} for key, out in results.items()}
    assert rows == {"grouped": {ids.shape[0]}, "expanded": {ids.shape[0] * expand}}


def check_padded_batch(model, modes=("greedy", "beam")):
    """Each sentence of the right-padded batch decodes alone as in the batch: the same tokens and step scores (as
    `assert_step_scores_close`), in float64 (see `as_float64`)."""
    model = as_float64(model)
    ids, mask = source_batch()
    for mode in modes:
        kwargs = dict(use_cache=True, output_scores=True, return_dict_in_generate=True, **generate_kwargs(mode))
        batched = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert_nontrivial(batched.sequences)
        per_row, beams = batched.sequences.shape[0] // ids.shape[0], kwargs.get("num_beams", 1)
        for i in range(ids.shape[0]):
            length = int(mask[i].sum())
            alone = dict(input_ids=ids[i : i + 1, :length], attention_mask=mask[i : i + 1, :length])
            single = model.generate(**alone, **kwargs)
            expected = batched.sequences[i * per_row : (i + 1) * per_row, : single.sequences.shape[1]]
            assert torch.equal(single.sequences, expected), \
                f"{mode}: row {i} alone {single.sequences.tolist()} != in batch {expected.tolist()}"
            for t, (alone, both) in enumerate(zip(single.scores, batched.scores, strict=True)):
                assert_step_scores_close(alone, both[i * beams : (i + 1) * beams], f"{mode}: row {i}, step {t}")


def check_save_load(model, tmp_path):
    """save_pretrained writes safetensors and a model card; AutoModelForSeq2SeqLM loads the same class with
    bit-identical weights, which then decodes exactly as the original (greedy, beam): fp32 on purpose, as the model
    is used, and exact because the same process runs the same kernels on the same inputs and weights."""
    from transformers import AutoModelForSeq2SeqLM

    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    card = (tmp_path / "README.md").read_text()
    assert model.config.model_type in card
    assert f"`transformers>={MIN_TRANSFORMERS}`" in card
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys()
    for key, value in original.items():
        assert value.dtype == loaded[key].dtype and torch.equal(value, loaded[key]), key
    for mode in ("greedy", "beam"):
        expected = run_generate(model, mode, True)
        assert_nontrivial(expected)
        assert torch.equal(run_generate(reloaded, mode, True), expected), mode
    return reloaded


# The start of a fresh process's script (argv[1]: the repository) in which hf_hardattn cannot be imported: what a
# user without the package has; remote code then comes from a saved folder only.
WITHOUT_PACKAGE = textwrap.dedent(
    """
    import copy, importlib, json, sys, os, traceback
    os.environ["HF_HUB_OFFLINE"] = "1"
    # hf_hardattn must NOT be importable: drop every path that could provide it
    sys.path = [p for p in sys.path if p and os.path.abspath(p) != os.path.abspath(sys.argv[1])]
    sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                     and "editable" not in type(f).__module__]
    sys.path_hooks = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
    sys.path_importer_cache.clear()
    try:
        import hf_hardattn  # noqa
        raise SystemExit("hf_hardattn is importable in the fresh process")
    except ImportError:
        pass
    """
)

REMOTE_SCRIPT = WITHOUT_PACKAGE + textwrap.dedent(
    """
    import torch
    from transformers import AutoModelForSeq2SeqLM, LogitsProcessorList
    STEP_RECORDER

    def check(folder, ids):
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        ids = torch.tensor(ids)
        kwargs = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=10, min_new_tokens=10)

        def recorded(m, **more):  # common.recorded_generate, as JSON lists
            recorder = StepRecorder()
            with torch.no_grad():
                out = m.generate(**kwargs, **more, logits_processor=LogitsProcessorList([recorder]),
                                 output_logits=True, return_dict_in_generate=True)
            return {"sequences": out.sequences.tolist(), "ids": [x.tolist() for x in recorder.ids],
                    "scores": [x.tolist() for x in recorder.scores], "logits": [x.float().tolist() for x in out.logits]}

        model64 = copy.deepcopy(model).double()
        result = {"class": type(model).__module__, "greedy64": model64.generate(**kwargs, do_sample=False).tolist(),
                  "beam64": model64.generate(**kwargs, num_beams=4).tolist(), "beam": recorded(model, num_beams=4)}
        # the CPU decoding option travels with the remote code; it needs oneDNN's prepacked linear in this torch build
        packing = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".packed_linear")
        result["packing_available"] = packing.packing_available()
        if result["packing_available"]:
            result["packed_beam"] = recorded(model.pack_linears(), num_beams=4)
        return result

    for line in sys.stdin:  # one request a line, {"folder", "ids"}; one answer a line
        request = json.loads(line)
        try:
            answer = "RESULT" + json.dumps(check(request["folder"], request["ids"]))
        except Exception:
            answer = "ERROR" + json.dumps(traceback.format_exc())
        print(answer, flush=True)
    """
)


class RemoteCodeProcess:
    """The fresh process of `check_remote_code`: hf_hardattn not importable, offline, run from an empty folder, started
    once and kept for the test session (importing torch and transformers is most of a fresh process's time; each check
    used to pay it). Each check loads its own saved folder with trust_remote_code: transformers copies the folder's
    code under a module path named after the folder (and its files' hash), so no check runs another's code. A folder
    name already loaded in this process (which could reuse that code) starts a new process."""

    current = None

    def __init__(self):
        import inspect
        import queue
        import tempfile
        import threading

        self.root = tempfile.mkdtemp(prefix="remote_code_")
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="",
                   HF_MODULES_CACHE=os.path.join(self.root, "modules_cache"))
        script = os.path.join(self.root, "remote_load.py")
        with open(script, "w") as handle:
            handle.write(REMOTE_SCRIPT.replace("STEP_RECORDER", inspect.getsource(StepRecorder)))
        workdir = os.path.join(self.root, "fresh")  # an empty folder; the script drops the project's path
        os.mkdir(workdir)
        self.stderr = open(os.path.join(self.root, "stderr.txt"), "w+")
        self.process = subprocess.Popen([sys.executable, script, repo_root], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env, cwd=workdir)
        self.lines, self.folders = queue.Queue(), set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the process ended

    def output(self):
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def close(self):
        import shutil

        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @classmethod
    def check(cls, folder, ids, timeout=300):
        """The script's result for the saved ``folder`` and the source ``ids`` (a list of rows)."""
        import atexit
        import queue

        name = os.path.basename(os.path.normpath(folder))
        if cls.current is not None and (name in cls.current.folders or cls.current.process.poll() is not None):
            cls.current.close()
            cls.current = None
        if cls.current is None:
            cls.current = cls()
            atexit.register(cls.current.close)
        process = cls.current
        process.folders.add(name)
        process.process.stdin.write(json.dumps({"folder": str(folder), "ids": ids}) + "\n")
        process.process.stdin.flush()
        while True:
            try:
                line = process.lines.get(timeout=timeout)
            except queue.Empty:
                output = process.output()
                process.close()  # (its late answer must not be read as the next check's)
                cls.current = None
                raise AssertionError(f"no answer from the fresh process in {timeout} s:\n{output}")
            assert line is not None, f"the fresh process ended:\n{process.output()}"
            if line.startswith("RESULT"):
                return json.loads(line[len("RESULT"):])
            assert not line.startswith("ERROR"), json.loads(line[len("ERROR"):])[-3000:] + process.output()


def check_remote_code(model, tmp_path):
    """Save, then load in a fresh process where hf_hardattn is not importable, offline, with trust_remote_code (one
    process serves the checks of a test session: `RemoteCodeProcess`). There and here the float64 model gives the same
    greedy and beam tokens (see `as_float64`). The fp32 model's beam search, and (where this torch build has oneDNN's
    prepacked linear, as `pack_linears` needs) the packed one's, decode as here: the fresh process may pick other
    threads and kernels, so exact tokens only where margins allow (of the 80 decisions of `decoding_batch()`, at least
    half clear)."""
    from hf_hardattn.packed_linear import packing_available

    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" in config and "AutoModelForSeq2SeqLM" in config["auto_map"]
    ids, mask = decoding_batch()
    assert_output_layer_premise(model)
    result = RemoteCodeProcess.check(tmp_path, ids.tolist())
    assert result["class"].startswith("transformers_modules"), result["class"]
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10)
    model64 = as_float64(model)
    greedy = run_generate(model64, "greedy", True, ids, mask)
    assert_nontrivial(greedy[:2])  # source_batch()'s two sentences, as the other checks (8 would hide a repeated token)
    assert result["greedy64"] == greedy.tolist()
    assert result["beam64"] == model64.generate(**kwargs, num_beams=4).tolist()
    beam = record_from_json(result["beam"])
    here = recorded_generate(model, **kwargs, num_beams=4)
    assert_same_tokens_where_margins_allow(here, beam, num_beams=4, min_steps=40)
    assert result["packing_available"] == packing_available()
    if packing_available():
        assert_same_tokens_where_margins_allow(beam, record_from_json(result["packed_beam"]), num_beams=4, min_steps=40)


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
    from hf_hardattn.caches import CACHE_FIELD

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
    """A tiny model of contract configuration ``name``: fitted on the reversal task (shared, built once per test run:
    do not modify it, deep-copy first) or, with ``fit=False``, a fresh randomized one."""
    if not fit:
        torch.manual_seed(0)
        return randomize(_contract_builders()[name]())
    if name not in _CONTRACT_FITTED:
        torch.manual_seed(0)  # the same initial weights whichever test asks first
        _CONTRACT_FITTED[name] = fitted(_contract_builders()[name](), steps=100)
    return _CONTRACT_FITTED[name]


# -- one fresh tiny model per model type, keywords overriding tiny_kwargs (model API, export, bf16 tests) -------------
RNN_KW = dict(decoder_layers=2, rnn_hidden_size=32)  # two GRU layers: dropout between them is checkpointed too


def _type_builders():
    import hf_hardattn as h

    return {
        "soft": lambda **kw: h.SoftTransformerForConditionalGeneration(h.SoftTransformerConfig(**tiny_kwargs(**kw))),
        "hard_retrieval": lambda **kw: h.HardRetrievalForConditionalGeneration(
            h.HardRetrievalConfig(**tiny_kwargs(**kw))),
        "gaussian": lambda **kw: h.GaussianForConditionalGeneration(
            h.GaussianConfig.preset("hc-all", **tiny_kwargs(**{"length_ratio": 1.3, **kw}))),
        "hybrid": lambda **kw: h.HybridForConditionalGeneration(h.HybridConfig(**tiny_kwargs(**RNN_KW, **kw))),
        "recurrent": lambda **kw: h.RecurrentForConditionalGeneration(h.RecurrentConfig(**tiny_kwargs(**kw))),
        "beam_joint_transformer": lambda **kw: h.BeamJointTransformerForConditionalGeneration(
            h.BeamJointTransformerConfig(**tiny_kwargs(joint_k=3, **kw))),
        "beam_joint_rnn": lambda **kw: h.BeamJointRNNForConditionalGeneration(  # the paper's Luong-style LSTM decoder
            h.BeamJointRNNConfig(**tiny_kwargs(**RNN_KW, joint_k=3, **kw))),
    }


TYPE_MODELS = _type_builders()  # model type -> (**config overrides) -> a fresh model
TYPE_NAMES = sorted(TYPE_MODELS)
JOINT_TYPES = ("beam_joint_transformer", "beam_joint_rnn")  # logits are the mixture's log-probabilities
DECODER_INPUTS = torch.tensor([[1, 6, 9, 12, 15], [1, 8, 10, 2, 0]])  # teacher-forced (the second row ends early)
UNPADDED = torch.tensor([[5, 9, 13, 17, 21, 25, 2], [7, 11, 19, 23, 2, 30, 31]])  # source_batch's shape, no padding


def forward_logits(model, ids=None, mask=None, dec=DECODER_INPUTS, dec_mask=None):
    """The logits of one forward without cache (default: source_batch() and DECODER_INPUTS)."""
    if ids is None:
        ids, mask = source_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask,
                     use_cache=False).logits


def traced_batches():
    """(source, source mask, decoder inputs, decoder mask): padded as traced, then the same shapes unpadded, where
    eager decoding takes its no-mask fast paths and a traced graph its general one."""
    ids, mask = source_batch()
    return ((ids, mask, DECODER_INPUTS, (DECODER_INPUTS != 0).long()),
            (UNPADDED, torch.ones_like(UNPADDED), DECODER_INPUTS, torch.ones_like(DECODER_INPUTS)))


def training_step(model, batch, seed=7, count_calls=True):
    """Loss and float64 gradients of one step from a fixed RNG state (dropout masks, hard-retrieval samples), and how
    often each module was called (a pre-hook: a recomputation stops once it has what backward needs, which may be
    before a module returns)."""
    calls = {}
    hooks = [module.register_forward_pre_hook(lambda m, i: calls.__setitem__(m, calls.get(m, 0) + 1))
             for module in model.modules()] if count_calls else []
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


ONE_PER_TYPE = ("soft", "hard_retrieval", "gaussian_hc_all", "hybrid_additive", "recurrent_expand_1",
                "beam_joint_transformer", "beam_joint_rnn")  # a contract model of each of the seven model types


BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def benchmark_script(name):
    """``benchmarks/NAME.py`` as ``python benchmarks/NAME.py`` runs it: its folder first on ``sys.path`` (the scripts
    import ``machine_kind`` and ``trained_models`` from beside themselves), whatever other test files put there."""
    folder = os.path.abspath(BENCHMARKS)
    if folder not in [os.path.abspath(path) for path in sys.path if path]:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------
# Interrupted training runs (resume tests)
# ----------------------------------------------------------------------------------------------------------------
class Interrupted(Exception):
    pass


class InterruptAt(TrainerCallback):
    """Raises :class:`Interrupted` before the step after ``at`` runs (checkpoint ``at`` saved): a run cut off between
    two steps, as a killed process or a session's end leaves it."""

    def __init__(self, at):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise Interrupted(self.at)


class Scripted(TrainerCallback):
    """A validation metric by step for a :class:`Convergence` rule (``rule(scripted)``): this callback, listed before
    the rule, notes the step the rule evaluates at."""

    def __init__(self, values):
        self.values, self.step = values, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def __call__(self, model):
        return self.values[self.step]
