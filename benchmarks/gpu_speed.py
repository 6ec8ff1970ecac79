"""Each paper's speed claim measured on one GPU at Transformer-base size, in bf16: one prepared run of <= 8 minutes.

Sizes (every model, random weights, seed 0): d_model 512, 6 encoder + 6 decoder layers, 8 heads, FFN 2048, vocab
32000 (Transformer-base). Hybrid 6-1 (the hybrid paper's): the same 6-layer encoder + 1 GRU decoder layer of hidden
1024 (embedding 512). Beam-joint RNN setting (the beam-joint paper's): the same encoder + 1 Luong-style LSTM decoder
layer of 512 with input feeding and dot attention, against the soft hybrid with the SAME decoder (as
benchmarks/beam_joint_bench.py). Models are built on the CPU in fp32 and then moved to the device.

Decoding (bf16 weights: ``model.to(device, torch.bfloat16)``, eval mode, ``generate`` with the KV cache): greedy and
beam 4, batch 1 and 64, source 24 tokens, 30 output tokens forced (min_new_tokens = max_new_tokens = 30, no EOS),
sentences/s = batch / median time of one ``generate`` call. Models: soft, attention_removed (the soft model whose
attention core returns the first value row without any scores: the ceiling for a change of the attention function
alone, as benchmarks/decode_speed.py), hard_retrieval, sh_x, hc_sa, hybrid_additive and hybrid_dot (6-1).

``--compiled``: soft, marian (transformers.MarianMTModel of the same sizes), attention_removed, hard_retrieval, sh_x,
hc_sa and hybrid_dot each eagerly and as ``<name>_compiled``: ``hf_hardattn.modeling_hardattn.compiled_decoding``'s
generate() keywords (static cache, the step compiled with ``fullgraph=True``, ``dynamic=True``; CUDA graphs on a GPU;
Marian through transformers' own path). Per setting it also records each model's first call (its compile, or its
graphs' recording for new shapes), each compiled model's tokens against its eager twin's, and torch's counters
(graphs compiled, CUDA graphs skipped); ``--profile`` adds torch.profiler's table of one greedy batch-1 call of soft
and soft_compiled. Its claims: the decoding claims below again between compiled models, soft_compiled / soft >= 4
(the project's target at greedy batch 1) and soft_compiled / marian_compiled >= 1.

Training step (forward + backward + Adam step, dropout 0.1, batch 64 sentences x 30 source + 30 target tokens, no
padding: 1920 target tokens, the batch of beam_joint_bench.py / recurrent_speed.py): fp32 weights and optimizer
state under ``torch.autocast(device, torch.bfloat16)``, which is what ``--precision bf16`` of the training commands
does (``Seq2SeqTrainingArguments(bf16=True)``: accelerate wraps the forward in bf16 autocast). Models: soft,
beam_joint_k6 (beam-joint K=6 in the last decoder layer), hybrid_rnn_soft vs beam_joint_rnn_k6 (the paper's RNN
setting), and the nine recurrent cross-attention variants.

Claims (ratio -> the paper's claim -> held when):
  * hard_retrieval / soft, sentences/s: hard retrieval paper 1.43x -> held when >= 1.43;
    hard_retrieval / attention_removed: the ceiling, the project's target >= 0.8x;
  * sh_x / soft, hc_sa / soft: Gaussian paper 1.30x, 1.06x -> held when >= the claim;
  * hybrid_{additive,dot} / soft: hybrid paper "about 4x" -> held when >= 4.0 (decode_speed.py's target);
  * beam_joint_k6 / soft and beam_joint_rnn_k6 / hybrid_rnn_soft, step time: beam-joint paper 1.2-1.3x the
    time -> held when <= 1.3;
  * recurrent_* / soft, step time: recurrent paper 5.4-7.9x with its position-by-position implementation -> held
    when <= 7.9 (no slower than the paper's); this package's target (recurrent_speed.py) <= 1.5x is recorded as
    ``target_met``.
  Every decoding ratio is reported for each of the four settings (greedy/beam 4 x batch 1/64).

Timing: ``torch.cuda.synchronize()`` before and after each timed call; warm-up rounds (``--warmup``) are run and not
recorded; within each setting the models run alternately round by round and the median per model is reported. The
run is bounded by ``--budget-seconds`` (default 420, from the script's start, model building included): each setting
gets an equal share of what is left, and stops after its rounds or its share, with at least one timed round. The
JSON is rewritten after every setting, so a run killed from outside keeps what it measured.

    python benchmarks/gpu_speed.py                   # -> benchmarks/results/gpu_speed_<gpu-name-slug or CPU kind>.json
    python benchmarks/gpu_speed.py --smoke           # tiny dims, bf16 on the CPU, one round: every code path, ~10 s
    bash benchmarks/run_gpu_speed.sh                 # what the GPU machine runs (output also under $OUT/)
    bash benchmarks/run_gpu_speed.sh --compiled --sections decoding --profile   # -> ..._compiled.json
"""

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch
import transformers

from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, GaussianConfig,
                         GaussianForConditionalGeneration, HardRetrievalConfig, HardRetrievalForConditionalGeneration,
                         HybridConfig, HybridForConditionalGeneration, RecurrentConfig,
                         RecurrentForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.layers import SoftAttention
from hf_hardattn.modeling_hardattn import compiled_decoding
from machine_kind import machine_kind

BASE = dict(dims=dict(vocab_size=32000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                      decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048),
            hybrid_hidden=1024, source_length=24, new_tokens=30, batch_sizes=[1, 64], train_batch=64,
            train_length=30)
SMOKE = dict(dims=dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64),
             hybrid_hidden=64, source_length=6, new_tokens=3, batch_sizes=[1, 3], train_batch=4, train_length=5)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
RECURRENT_VARIANTS = ("concat_context", "concat_weight", "concat_accumulated", "expand_1", "expand_2", "expand_3",
                      "expand_4", "continuity", "coverage")  # hf_hardattn.recurrent.RECURRENT_VARIANTS
DECODE_MODELS = ("soft", "attention_removed", "hard_retrieval", "sh_x", "hc_sa", "hybrid_additive", "hybrid_dot")
# --compiled: each of these eager and as ``<name>_compiled`` (hf_hardattn.modeling_hardattn.compiled_decoding's
# generate() keywords: static cache, the step compiled with fullgraph=True, CUDA graphs on a GPU); Marian through
# transformers' own static cache + compile path
COMPILED_MODELS = ("soft", "marian", "attention_removed", "hard_retrieval", "sh_x", "hc_sa", "hybrid_dot")
TRAIN_MODELS = ("soft", "beam_joint_k6", "hybrid_rnn_soft", "beam_joint_rnn_k6") + tuple(
    f"recurrent_{v}" for v in RECURRENT_VARIANTS)
MODES = (("greedy", 1), ("beam4", 4))
SEEDS = dict(model_weights=0, decode_source_ids=1, train_source_ids=2, train_labels=3)  # random weights and inputs

# (section, numerator, denominator, source, claim text, op, value[, target op, target value])
# decoding ratios: sentences/s of numerator / denominator (> 1: numerator faster);
# training ratios: step time of numerator / denominator (> 1: numerator slower).
CLAIMS = [
    ("decoding", "hard_retrieval", "soft", "hard retrieval paper", "1.43x soft's decoding speed", ">=", 1.43),
    ("decoding", "hard_retrieval", "attention_removed", "project target (attention removed is the ceiling)",
     ">= 0.8x attention removed", ">=", 0.8),
    ("decoding", "sh_x", "soft", "Gaussian paper", "1.30x soft's decoding speed", ">=", 1.30),
    ("decoding", "hc_sa", "soft", "Gaussian paper", "1.06x soft's decoding speed", ">=", 1.06),
    ("decoding", "hybrid_additive", "soft", "hybrid paper (6-1)", "about 4x soft's decoding speed", ">=", 4.0),
    ("decoding", "hybrid_dot", "soft", "hybrid paper (6-1)", "about 4x soft's decoding speed", ">=", 4.0),
    ("training", "beam_joint_k6", "soft", "beam-joint paper (future work: Transformer)",
     "1.2-1.3x soft's training time", "<=", 1.3),
    ("training", "beam_joint_rnn_k6", "hybrid_rnn_soft", "beam-joint paper (its RNN setting)",
     "1.2-1.3x soft's training time", "<=", 1.3),
] + [("training", f"recurrent_{v}", "soft", "recurrent paper",
      "5.4-7.9x soft's training time with its position-by-position implementation", "<=", 7.9, "<=", 1.5)
     for v in RECURRENT_VARIANTS]


# --compiled: the decoding claims again between compiled models, and the compiled path's own targets
COMPILED_CLAIMS = [
    ("decoding", "soft_compiled", "soft", "project target (static cache, compiled step, CUDA graphs)",
     ">= 4x eager generate() (at greedy batch 1)", ">=", 4.0),
    ("decoding", "soft_compiled", "marian_compiled", "project target",
     "ahead of MarianMTModel's static cache + compile", ">=", 1.0),
] + [(section, f"{num}_compiled", f"{den}_compiled", *rest) for section, num, den, *rest in CLAIMS
     if section == "decoding" and num in COMPILED_MODELS and den in COMPILED_MODELS]


def compare(value, op, threshold):
    return value >= threshold if op == ">=" else value <= threshold


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
def removed_attend(q, k, v, mask, causal):
    """No scores, no normalisation, no weighted sum: every query returns the first value row."""
    return v[:, :, :1].expand(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def build(name, size, training):
    dims = dict(size["dims"], **SPECIAL, **(dict(dropout=0.1) if training else {}))
    if name == "marian":  # decode_speed.py's MarianMTModel of the same sizes
        return transformers.MarianMTModel(transformers.MarianConfig(
            **dims, activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
            forced_eos_token_id=None, max_position_embeddings=512))
    rnn = dict(dims, decoder_layers=1)
    if name in ("soft", "attention_removed"):
        model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**dims))
        if name == "attention_removed":
            for module in model.modules():
                if isinstance(module, SoftAttention):
                    module.attend = removed_attend
        return model
    if name == "hard_retrieval":
        return HardRetrievalForConditionalGeneration(HardRetrievalConfig(**dims))
    if name in ("sh_x", "hc_sa"):
        return GaussianForConditionalGeneration(GaussianConfig.preset(name.replace("_", "-"), **dims))
    if name.startswith("hybrid_") and name != "hybrid_rnn_soft":  # the hybrid paper's 6-1: GRU of 1024
        return HybridForConditionalGeneration(HybridConfig(
            **rnn, rnn_hidden_size=size["hybrid_hidden"], rnn_embedding_size=dims["d_model"],
            rnn_attention=name.split("_", 1)[1]))
    luong = dict(rnn, rnn_hidden_size=dims["d_model"], rnn_decoder_style="luong", rnn_cell="lstm",
                 rnn_attention="dot")  # beam_joint_bench.py's setting 1 (the paper's decoder)
    if name == "hybrid_rnn_soft":
        return HybridForConditionalGeneration(HybridConfig(**luong))
    if name == "beam_joint_rnn_k6":
        return BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**luong, joint_k=6))
    if name == "beam_joint_k6":
        return BeamJointTransformerForConditionalGeneration(BeamJointTransformerConfig(**dims, joint_k=6))
    if name.startswith("recurrent_"):
        return RecurrentForConditionalGeneration(RecurrentConfig(**dims, recurrent_variant=name[len("recurrent_"):]))
    raise ValueError(name)


def error_text(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


class Budget:
    """Seconds from the script's start; each setting gets an equal share of what is left."""

    def __init__(self, seconds, start):
        self.seconds, self.start = seconds, start

    def elapsed(self):
        return time.perf_counter() - self.start

    def share(self, settings_left):
        return max(0.0, self.seconds - self.elapsed()) / max(1, settings_left)


def interleaved(label, names, call, device, rounds, warmup, deadline, errors, first=None):
    """Times ``call(name)`` for every name, alternating round by round; warm-up rounds not recorded. A model that
    raises is recorded in ``errors`` and left out of the later rounds. ``first``: a dict that gets each model's first
    call's time (a compiled model's compile, or its CUDA graphs' recording for new shapes). Returns (times per model,
    rounds done, whether the deadline stopped it)."""
    alive = list(names)
    times = {name: [] for name in names}
    first = {} if first is None else first

    def attempt(name, record):
        try:
            elapsed = timed(lambda: call(name), device)
            first.setdefault(name, elapsed)
        except Exception as exc:  # noqa: BLE001 -- one model's failure must not lose the others' numbers
            errors[name] = error_text(exc)
            print(f"  {label}: {name} FAILED: {errors[name].splitlines()[-1]}", flush=True)
            alive.remove(name)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if record:
            times[name].append(elapsed)

    for _ in range(warmup):
        for name in list(alive):
            attempt(name, record=False)
    done, stopped = 0, False
    for round_ in range(rounds):
        if round_ > 0 and time.perf_counter() > deadline:
            stopped = True
            break
        for name in list(alive):
            attempt(name, record=True)
        done += 1
        print(f"  {label} round {round_ + 1}/{rounds}: "
              + ", ".join(f"{n} {times[n][-1] * 1000:.1f}ms" for n in alive), flush=True)
    return {n: t for n, t in times.items() if t}, done, stopped


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def slug(text):
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def environment(device, args):
    cuda, matmul = device.type == "cuda", torch.backends.cuda.matmul
    return dict(
        device=str(device), gpu_name=torch.cuda.get_device_name(device) if cuda else None,
        gpu_capability=list(torch.cuda.get_device_capability(device)) if cuda else None,
        gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
        cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads(),
        python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        settings=dict(
            matmul_allow_tf32=matmul.allow_tf32, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            matmul_allow_bf16_reduced_precision_reduction=matmul.allow_bf16_reduced_precision_reduction,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")),
        smoke=args.smoke)


def compiled_report(outputs, first):
    """--compiled, per setting: each model's first call (s; a compiled model's compile or its CUDA graphs' recording
    for new shapes), each compiled model's tokens against its eager twin's (last call: the share of equal tokens, of
    equal rows), and torch's counters so far (graphs compiled, CUDA graph skips)."""
    agreement = {}
    for name, out in outputs.items():
        twin = outputs.get(name.removesuffix("_compiled"))
        if name.endswith("_compiled") and twin is not None:
            agreement[name] = dict(tokens=(out == twin).double().mean().item(),
                                   rows=(out == twin).all(dim=1).double().mean().item())
    counters = torch._dynamo.utils.counters
    return dict(first_call_s={n: round(t, 4) for n, t in first.items()}, agreement_with_eager=agreement,
                counters=dict(unique_graphs=counters["stats"]["unique_graphs"],
                              cudagraph_skips=counters["inductor"]["cudagraph_skips"]))


def profile_call(model, ids, new_tokens, device):
    """One greedy batch-1 ``generate`` under torch.profiler: its wall time, the host (CPU) and device time of the
    operators, and the 20 operators of most host time (the table as text)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def call():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, num_beams=1, do_sample=False)

    with torch.inference_mode():
        timed(call, device)  # warm: the shapes of the last setting were another's
        with torch.profiler.profile(activities=activities) as prof:
            wall = timed(call, device)
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    return dict(wall_s=wall, host_self_us=sum(e.self_cpu_time_total for e in events), device_self_us=device_us,
                table=events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def make_ids(batch, length, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, length), generator=generator)


def claims_for(result):
    """The claims a result is judged by: the papers' (CLAIMS); with --compiled, the decoding ones (eager and
    COMPILED_CLAIMS) whose two models were asked for, and the training ones."""
    protocol = result["protocol"]
    if not protocol.get("compiled"):
        return CLAIMS
    asked = {"decoding": protocol["decode_models"], "training": TRAIN_MODELS}
    return [claim for claim in CLAIMS + COMPILED_CLAIMS if claim[0] in protocol["sections"]
            and claim[1] in asked[claim[0]] and claim[2] in asked[claim[0]]]


def claims_table(result):
    """One row per (claim, setting): the ratio of the medians, the claim, held (None where a model is missing)."""
    rows = []
    for claim in claims_for(result):
        section, num, den, source, text, op, value = claim[:7]
        target = claim[7:] or None
        settings = result["decoding"] if section == "decoding" else [result["training"]]
        for setting in settings:
            models = setting.get("models", {})
            ratio = None
            if num in models and den in models:
                if section == "decoding":
                    ratio = models[num]["sentences_per_s"] / models[den]["sentences_per_s"]
                else:
                    ratio = models[num]["median_s"] / models[den]["median_s"]
            row = dict(section=section, numerator=num, denominator=den,
                       metric="sentences/s ratio" if section == "decoding" else "step time ratio",
                       ratio=ratio, claim=dict(source=source, text=text, op=op, value=value),
                       held=None if ratio is None else compare(ratio, op, value))
            if section == "decoding":
                row.update(mode=setting["mode"], batch_size=setting["batch_size"])
            if target:
                row["target"] = dict(source="recurrent_speed.py target", op=target[0], value=target[1])
                row["target_met"] = None if ratio is None else compare(ratio, *target)
            rows.append(row)
    return rows


def write(result, path):
    result["claims"] = claims_table(result)
    held = [row["held"] for row in result["claims"]]
    result["summary"] = dict(claims=len(held), held=held.count(True), not_held=held.count(False),
                             missing=held.count(None), elapsed_s=round(time.perf_counter() - START, 2))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(path + ".tmp", path)


START = time.perf_counter()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny dims, 1 round, 1 warm-up, 1 CPU thread (every model, both sections)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: decoding with bf16 weights, training under bf16 autocast (default, --smoke too)")
    parser.add_argument("--decode-rounds", type=int, default=None, help="timed rounds per setting (default 7)")
    parser.add_argument("--train-rounds", type=int, default=None, help="timed training rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds per setting (default 2)")
    parser.add_argument("--budget-seconds", type=float, default=420.0,
                        help="wall time from the start, building included (settings shrink to fit; default 420)")
    parser.add_argument("--compiled", action="store_true",
                        help="decode each of " + ", ".join(COMPILED_MODELS) + " eagerly and as <name>_compiled (static "
                             "cache, compiled step; CUDA graphs on a GPU): the compiled claims; default output "
                             "gpu_speed_<gpu>_compiled.json")
    parser.add_argument("--compiled-models", nargs="+", choices=COMPILED_MODELS, default=list(COMPILED_MODELS),
                        help="with --compiled: which of them (default all)")
    parser.add_argument("--profile", action="store_true",
                        help="after decoding, torch.profiler over one greedy batch-1 call of soft (and soft_compiled)")
    parser.add_argument("--modes", nargs="+", choices=[m for m, _ in MODES], default=[m for m, _ in MODES],
                        help="decoding modes (default greedy beam4)")
    parser.add_argument("--sections", nargs="+", choices=("decoding", "training"), default=["decoding", "training"])
    parser.add_argument("--output", default=None,
                        help="default benchmarks/results/gpu_speed_<gpu-name-slug>.json (gpu_speed_cpu_smoke.json "
                             "for --smoke on a CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; smoke: 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="decoding batch sizes (default 1 64; smoke 1 3)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_seconds, START)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or 1)  # tiny ops: threads only wait for each other
    size = dict(SMOKE if args.smoke else BASE)
    if args.batch_sizes:
        if min(args.batch_sizes) < 1:
            parser.error(f"--batch-sizes must be positive integers, got {args.batch_sizes}")
        size["batch_sizes"] = args.batch_sizes
    decode_rounds = args.decode_rounds or (1 if args.smoke else 7)
    train_rounds = args.train_rounds or (1 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    env = environment(device, args)
    name = env["gpu_name"] or "cpu"
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"gpu_speed_{slug(env['gpu_name']) if env['gpu_name'] else machine_kind()}"
                                         f"{'_compiled' if args.compiled else ''}{'_smoke' if args.smoke else ''}.json")
    bf16 = args.precision == "bf16"
    decode_names = [f"{n}{suffix}" for n in args.compiled_models for suffix in ("", "_compiled")] \
        if args.compiled else list(DECODE_MODELS)
    if args.compiled and device.type == "cuda":
        torch._logging.set_logs(perf_hints=True)  # says why CUDA graphs were skipped, if they are
    print(f"gpu_speed: {name} ({device}), torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, precision {args.precision}, budget {args.budget_seconds:.0f}s, -> {output}",
          flush=True)
    result = dict(
        script="benchmarks/gpu_speed.py", environment=env,
        precision=dict(name=args.precision,
                       decoding="bf16 weights (model.to(device, torch.bfloat16))" if bf16 else "fp32 weights",
                       training=("fp32 weights and Adam state, forward under torch.autocast(bf16), as --precision "
                                 "bf16 (Trainer bf16=True)") if bf16 else "fp32, no autocast"),
        sizes=dict(dims=size["dims"], special_tokens=SPECIAL, hybrid_6_1=dict(decoder_layers=1,
                   rnn_cell="gru", rnn_hidden_size=size["hybrid_hidden"], rnn_embedding_size=size["dims"]["d_model"]),
                   beam_joint_rnn=dict(decoder_layers=1, rnn_cell="lstm", rnn_decoder_style="luong",
                                       rnn_attention="dot", rnn_hidden_size=size["dims"]["d_model"], joint_k=6),
                   source_length=size["source_length"], new_tokens=size["new_tokens"],
                   decode_batch_sizes=size["batch_sizes"], train_batch=size["train_batch"],
                   train_source_length=size["train_length"], train_target_length=size["train_length"],
                   train_dropout=0.1),
        protocol=dict(decode_rounds=decode_rounds, train_rounds=train_rounds, warmup_rounds=warmup,
                      budget_seconds=args.budget_seconds, median="per model over its timed rounds",
                      timing="time.perf_counter() between torch.cuda.synchronize() calls (cuda)",
                      interleaved="models alternate within each round", compiled=args.compiled,
                      decode_models=list(decode_names), sections=list(args.sections),
                      seeds=SEEDS),
        models={}, build_errors={}, decoding=[], training={})
    sections = [s for s in ("decoding", "training") if s in args.sections]

    # ---- build everything first (CPU, fp32, seed 0), then move to the device
    decode_models, train_models = {}, {}
    for section, names, target in (("decoding", decode_names, decode_models),
                                   ("training", TRAIN_MODELS, train_models)):
        if section not in sections:
            continue
        for model_name in names:
            start = time.perf_counter()
            try:
                torch.manual_seed(SEEDS["model_weights"])
                model = build(model_name.removesuffix("_compiled"), size, training=section == "training")
                params = sum(p.numel() for p in model.parameters())
                if section == "decoding":
                    model = model.to(device, torch.bfloat16 if bf16 else torch.float32).eval()
                    if model_name.endswith("_compiled"):  # after the move: the device decides on CUDA graphs
                        model.generation_config.update(**compiled_decoding(model))
                else:
                    model = model.to(device).train()
                    model = (model, torch.optim.Adam(model.parameters(), lr=1e-4))
            except Exception as exc:  # noqa: BLE001
                result["build_errors"][f"{section}/{model_name}"] = error_text(exc)
                print(f"build {section}/{model_name} FAILED: {error_text(exc).splitlines()[-1]}", flush=True)
                continue
            target[model_name] = model
            result["models"][f"{section}/{model_name}"] = dict(params=params,
                                                              build_s=round(time.perf_counter() - start, 3))
        print(f"built {len(target)} {section} models, {budget.elapsed():.1f}s", flush=True)
    result["build_s"] = round(budget.elapsed(), 2)
    settings_left = (len(args.modes) * len(size["batch_sizes"]) if "decoding" in sections else 0) + (
        1 if "training" in sections else 0)

    # ---- decoding
    if "decoding" in sections:
        for mode, beams in [(m, b) for m, b in MODES if m in args.modes]:
            for batch_size in size["batch_sizes"]:
                ids = make_ids(batch_size, size["source_length"], size["dims"]["vocab_size"],
                               seed=SEEDS["decode_source_ids"]).to(device)
                ids[:, -1] = SPECIAL["eos_token_id"]
                mask = torch.ones_like(ids)
                new_tokens = size["new_tokens"]

                outputs = {}

                def call(model_name, ids=ids, mask=mask, beams=beams, outputs=outputs):
                    with torch.inference_mode():
                        out = decode_models[model_name].generate(
                            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, num_beams=beams, do_sample=False, use_cache=True)
                    if out.shape != (ids.shape[0], new_tokens + 1):
                        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected "
                                           f"{(ids.shape[0], new_tokens + 1)}")
                    outputs[model_name] = out

                label = f"{mode} b{batch_size}"
                share = budget.share(settings_left)
                errors, first = {}, {}
                times, done, stopped = interleaved(label, list(decode_models), call, device, decode_rounds, warmup,
                                                   time.perf_counter() + share, errors, first)
                settings_left -= 1
                models = {}
                for model_name, values in times.items():
                    median = statistics.median(values)
                    models[model_name] = dict(times_s=[round(v, 6) for v in values], median_s=median,
                                              sentences_per_s=batch_size / median)
                setting = dict(mode=mode, num_beams=beams, batch_size=batch_size, new_tokens=new_tokens, rounds=done,
                               stopped_by_budget=stopped, share_s=round(share, 2), models=models, errors=errors)
                if args.compiled:
                    setting.update(compiled_report(outputs, first))
                result["decoding"].append(setting)
                print(f"{label}: " + ", ".join(f"{n} {m['sentences_per_s']:.2f} sent/s" for n, m in models.items())
                      + f"  [{budget.elapsed():.0f}s]", flush=True)
                write(result, output)
        if args.profile:  # where a greedy batch-1 call's time goes, eager and compiled
            ids = make_ids(1, size["source_length"], size["dims"]["vocab_size"],
                           seed=SEEDS["decode_source_ids"]).to(device)
            for model_name in [n for n in ("soft", "soft_compiled") if n in decode_models]:
                result.setdefault("profile", {})[model_name] = profile_call(
                    decode_models[model_name], ids, size["new_tokens"], device)
                print(f"profile {model_name}:\n{result['profile'][model_name]['table']}", flush=True)
            write(result, output)
        del decode_models
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- training steps
    if "training" in sections:
        vocab = size["dims"]["vocab_size"]
        source = make_ids(size["train_batch"], size["train_length"], vocab, seed=SEEDS["train_source_ids"])
        labels = make_ids(size["train_batch"], size["train_length"], vocab, seed=SEEDS["train_labels"])
        batch = dict(input_ids=source.to(device), attention_mask=torch.ones_like(source).to(device),
                     labels=labels.to(device))

        def step(model_name):
            model, optimizer = train_models[model_name]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if not torch.isfinite(loss.detach()).item():  # after the step: the check's sync is inside the timing
                raise FloatingPointError(f"loss {loss.item()}")

        share = budget.share(settings_left)
        errors = {}
        times, done, stopped = interleaved("train", list(train_models), step, device, train_rounds, warmup,
                                           time.perf_counter() + share, errors)
        tokens = size["train_batch"] * size["train_length"]
        models = {}
        for model_name, values in times.items():
            median = statistics.median(values)
            models[model_name] = dict(times_s=[round(v, 6) for v in values], median_s=median,
                                      target_tokens_per_s=tokens / median)
        result["training"] = dict(batch_size=size["train_batch"], source_length=size["train_length"],
                                  target_length=size["train_length"], rounds=done, stopped_by_budget=stopped,
                                  share_s=round(share, 2), models=models, errors=errors,
                                  peak_memory_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                                  if device.type == "cuda" else None)
        print("train: " + ", ".join(f"{n} {m['median_s'] * 1000:.1f}ms" for n, m in models.items())
              + f"  [{budget.elapsed():.0f}s]", flush=True)

    write(result, output)
    lines = ["| ratio | setting | measured | claim | held |", "| --- | --- | ---: | --- | --- |"]
    for row in result["claims"]:
        setting = f"{row['mode']} b{row['batch_size']}" if row["section"] == "decoding" else "train step"
        ratio = "missing" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        held = {True: "held", False: "not held", None: "-"}[row["held"]]
        if "target" in row and row["target_met"] is not None:
            met = "met" if row["target_met"] else "missed"
            held += f" (target {row['target']['op']} {row['target']['value']}x: {met})"
        lines.append(f"| {row['numerator']} / {row['denominator']} | {setting} | {ratio} | "
                     f"{row['claim']['source']}: {row['claim']['op']} {row['claim']['value']}x | {held} |")
    print("\n".join(lines))
    summary = result["summary"]
    print(f"claims: {summary['held']} held, {summary['not_held']} not held, {summary['missing']} missing; "
          f"{summary['elapsed_s']:.0f}s in all", flush=True)
    print("wrote", output, flush=True)
    return result


if __name__ == "__main__":
    main()
