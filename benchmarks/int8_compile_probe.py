"""int8 under torch.compile, a quick comparison: the soft Transformer-base model that ``decode_speed.py`` decodes in
int8 (``soft_int8``: CTranslate2's weights), per generated token, in these forms timed in alternation within one run:

* ``fbgemm``: ``quantize_int8()`` (torch's packed dynamic int8 linears, eager);
* ``fbgemm_compiled``: the same model with ``compiled_decoding(model)`` (static cache, steps compiled by inductor
  around fbgemm's kernel, called through ``packed_linear.INT8_LINEAR_OP``);
* ``traced_eager``: ``quantize_int8(engine="traced")`` run eagerly (``torch._int_mm`` per layer);
* ``traced_compiled``: the same layers with ``compiled_decoding(model)``;
* ``fbgemm_op_compiled`` (``--fbgemm-op``, the first prototype of ``fbgemm_compiled``): the fbgemm layers called
  through a custom operator of this script (``probe::fbgemm_linear``).

It prints the seconds per token of each (median over ``--repeats`` rounds), the compile (first call) time, the ratios
to fbgemm and whether the tokens agree with fbgemm's and traced_eager's; ``--profile`` adds torch.profiler's top
operators of one compiled generate() call. For the full table use ``decode_speed.py --models soft_int8
soft_int8_compiled soft_int8_traced_compiled ct2_int8``.

    python benchmarks/int8_compile_probe.py --repeats 3
    python benchmarks/int8_compile_probe.py --settings greedy:1 beam4:1 --profile
"""

import argparse
import copy
import statistics
import time

import torch

from decode_speed import SOURCE_LENGTH, build_soft_from_marian
from hf_hardattn.modeling_hardattn import compiled_decoding
from hf_hardattn.packed_linear import Int8Linear

PACKED = {}  # the key buffer's address -> the layer's packed fbgemm weights (the prototype's lookup)


def fbgemm_op():
    """``probe::fbgemm_linear(x, key, out_features)``: fbgemm's dynamic int8 linear on the packed weights registered
    under ``key``'s address, with a shape-only fake for tracing."""
    library = torch.library.Library("probe", "DEF")
    library.define("fbgemm_linear(Tensor x, Tensor key, int out_features) -> Tensor")
    library.impl("fbgemm_linear", lambda x, key, out_features: torch.ops.quantized.linear_dynamic.default._op(
        x, PACKED[key.data_ptr()], True), "CPU")
    torch.library.register_fake("probe::fbgemm_linear", lambda x, key, out_features: x.new_empty(
        *x.shape[:-1], out_features), lib=library)
    return library


class OpLinear(torch.nn.Module):
    """An :class:`Int8Linear` called through ``probe::fbgemm_linear``."""

    def __init__(self, layer):
        super().__init__()
        self.register_buffer("key", torch.zeros(1))
        PACKED[self.key.data_ptr()] = layer._packed_params._packed_params
        self.out_features = layer.out_features

    def forward(self, x):
        return torch.ops.probe.fbgemm_linear.default(x, self.key, self.out_features)


def through_op(model):
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear):
            model.set_submodule(name, OpLinear(module))
    return model


def sources(batch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 8000, (batch, SOURCE_LENGTH), generator=generator)
    ids[:, -1] = 2
    return ids


def run(model, ids, beams, tokens, extra):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, num_beams=beams, do_sample=False, **extra)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["greedy:1", "beam4:1", "greedy:32"],
                        help="MODE:BATCH pairs, MODE greedy or beam4 (default: greedy:1 beam4:1 greedy:32)")
    parser.add_argument("--tokens", type=int, default=30, help="tokens generated per sentence (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per setting (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="profile one compiled call per setting")
    parser.add_argument("--fbgemm-op", action="store_true",
                        help="add the prototype: fbgemm's int8 linear as a custom operator inside compiled steps")
    parser.add_argument("--unguarded", action="store_true",
                        help="compile without dynamo's guards on the modules (guard_filter_fn; a separate run)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = build_soft_from_marian().eval()
    # --unguarded: without dynamo's guards on the modules (checked before every compiled step); one process holds
    # one compiled step per code object and guard set, so the guarded and unguarded forms are separate runs
    unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    options = {"options": unguarded} if args.unguarded else {}
    fbgemm, traced = copy.deepcopy(base).quantize_int8(), copy.deepcopy(base).quantize_int8(engine="traced")
    forms = {"fbgemm": (fbgemm, {}), "fbgemm_compiled": (fbgemm, compiled_decoding(fbgemm, **options)),
             "traced_eager": (traced, {}), "traced_compiled": (traced, compiled_decoding(traced, **options))}
    if args.fbgemm_op:
        library = fbgemm_op()  # noqa: F841  (kept alive: the operator lives as long as its library)
        model = through_op(copy.deepcopy(forms["fbgemm"][0]))
        forms["fbgemm_op_compiled"] = (model, compiled_decoding(model))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for setting in args.settings:
        mode, batch = setting.split(":")
        beams = 4 if mode == "beam4" else 1
        ids = sources(int(batch))
        first, tokens = {}, {}
        for name, (model, extra) in forms.items():  # first calls (compiles) and the tokens
            start = time.perf_counter()
            tokens[name] = run(model, ids, beams, args.tokens, extra)
            first[name] = time.perf_counter() - start
        times = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, (model, extra) in forms.items():
                start = time.perf_counter()
                run(model, ids, beams, args.tokens, extra)
                times[name].append((time.perf_counter() - start) / args.tokens)
        median = {name: statistics.median(values) for name, values in times.items()}
        print(f"\n{setting}: ms per token (median of {args.repeats}), first call s, tokens equal to fbgemm's / "
              f"traced_eager's")
        for name in forms:
            print(f"  {name:15s} {1e3 * median[name]:8.2f} ms  {median['fbgemm'] / median[name]:5.2f}x fbgemm  "
                  f"first {first[name]:6.1f} s  same tokens: "
                  f"{torch.equal(tokens[name], tokens['fbgemm'])} / "
                  f"{torch.equal(tokens[name], tokens['traced_eager'])}")
        if args.profile:
            from torch.profiler import profile

            model, extra = forms["fbgemm_compiled"]
            with profile() as prof:
                run(model, ids, beams, args.tokens, extra)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
