"""Candidate CPU kernels for int8 decoding, per linear layer: which library kernel is fastest at the weight
shapes of a Transformer-base decoder and the row counts of decoding (batch x beams), and what it costs in accuracy.

Kernels, each on the same weights and input, under no_grad, alternating round by round:

* ``fp32``: ``nn.Linear`` (MKL through ``F.linear``);
* ``fp32_packed``: the same after ``pack_linears`` (oneDNN prepacked fp32: this package's fastest path today);
* ``bf16``: ``nn.Linear`` with bf16 weights and input (oneDNN; CPUs with native bf16);
* ``int8_ao``: ``torch.ao.quantization.quantize_dynamic`` (fbgemm: int8 weights per output channel, activations
  quantised per call; deprecated in torch but shipped with 2.13);
* ``int8_torchao``: torchao's ``Int8DynamicActivationInt8WeightConfig`` (if torchao is installed);
* ``int8wo_torchao``: torchao's ``Int8WeightOnlyConfig`` (int8 weights, fp32 compute; if installed).

Prints the time per call relative to ``fp32_packed`` (above 1: faster than it) and the relative output error
max|y - y_fp32| / max|y_fp32| of each kernel, for every shape (out x in) and row count.

    python benchmarks/linear_int8.py --threads 2      # -> benchmarks/results/linear_int8_KIND.json
"""

import argparse
import copy
import json
import os
import statistics
import warnings

import torch

from hf_hardattn.packed_linear import pack_linears
from hf_hardattn.tools.training import machine
from linear_kernels import per_call  # (benchmarks/: the same timing loop)
from machine_kind import default_output

SHAPES = [(512, 512), (1536, 512), (2048, 512), (512, 2048), (8000, 512)]  # o-proj, qkv, ffn1, ffn2, vocab
ROWS = [1, 4, 32, 128]


def kernels(plain):
    """name -> (module, input dtype) for the kernels available here."""
    out = {"fp32": (plain, torch.float32)}
    out["fp32_packed"] = (pack_linears(torch.nn.Sequential(copy.deepcopy(plain)), max_rows=max(ROWS))[0], torch.float32)
    out["bf16"] = (copy.deepcopy(plain).to(torch.bfloat16), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        from torch.ao.quantization import quantize_dynamic

        out["int8_ao"] = (quantize_dynamic(torch.nn.Sequential(copy.deepcopy(plain)), {torch.nn.Linear},
                                           dtype=torch.qint8)[0], torch.float32)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        return out
    for name, config in (("int8_torchao", Int8DynamicActivationInt8WeightConfig()),
                         ("int8wo_torchao", Int8WeightOnlyConfig())):
        module = torch.nn.Sequential(copy.deepcopy(plain))
        quantize_(module, config)
        out[name] = (module[0], torch.float32)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--output", default=default_output("linear_int8"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    speed, error, names = {}, {}, None
    load_before = os.getloadavg()
    with torch.no_grad():
        for out_features, in_features in SHAPES:
            plain = torch.nn.Linear(in_features, out_features)
            torch.nn.init.normal_(plain.weight, std=in_features**-0.5)  # trained-like scale
            modules = kernels(plain)
            names = list(modules)
            for rows in ROWS:
                x = torch.randn(rows, in_features)
                reference = plain(x)
                times = {name: [] for name in modules}
                for name, (module, dtype) in modules.items():
                    y = module(x.to(dtype)).float()
                    error[name, out_features, in_features, rows] = float((y - reference).abs().max()
                                                                         / reference.abs().max())
                for _ in range(args.rounds):
                    for name, (module, dtype) in modules.items():
                        xi = x.to(dtype)
                        times[name].append(per_call(lambda: module(xi), args.calls))
                base = statistics.median(times["fp32_packed"])
                for name in modules:
                    speed[name, out_features, in_features, rows] = base / statistics.median(times[name])
    load_after = os.getloadavg()
    lines = ["| kernel | rows | " + " | ".join(f"{o}x{i}" for o, i in SHAPES) + " | max relative error |",
             "| --- | ---: |" + " ---: |" * len(SHAPES) + " ---: |"]
    for name in names:
        for rows in ROWS:
            worst = max(error[name, o, i, rows] for o, i in SHAPES)
            lines.append(f"| {name} | {rows} | " + " | ".join(f"{speed[name, o, i, rows]:.2f}x" for o, i in SHAPES)
                         + f" | {worst:.1e} |")
    table = "\n".join(lines)
    print(f"speed relative to fp32_packed per call (above 1: faster), {args.threads} threads; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after:\n")
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump({"rounds": args.rounds, "calls": args.calls, **machine(), "load_before": load_before,
                   "load_after": load_after, "table": table,
                   "speed_vs_fp32_packed": {f"{k[0]} {k[1]}x{k[2]} rows {k[3]}": v for k, v in speed.items()},
                   "relative_error": {f"{k[0]} {k[1]}x{k[2]} rows {k[3]}": v for k, v in error.items()}},
                  handle, indent=2)


if __name__ == "__main__":
    main()
