"""A plain ``nn.Linear`` (MKL, through ``F.linear``) against the same layer after ``pack_linears`` (oneDNN's prepacked
kernel, hf_hardattn/packed_linear.py), per call under no_grad, for the weight shapes of a Transformer-base decoder
and the row counts of decoding (batch x beams) and encoding. Inputs are shaped [rows, 1, in] as in a decoding step.

Prints the time ratio plain / packed (above 1: packed is faster), per weight shape (out x in features) and row
count, layer call overheads included; ``pack_linears``' default ``max_rows`` is chosen from it. Both layers run in
one process, alternating, on the same input; the median of ``--rounds`` rounds of ``--calls`` calls is taken.

    python benchmarks/linear_kernels.py            # -> benchmarks/results/linear_kernels_KIND.json
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from hf_hardattn.packed_linear import pack_linears
from hf_hardattn.tools.training import machine
from machine_kind import default_output

SHAPES = [(512, 512), (1536, 512), (2048, 512), (512, 2048), (8000, 512)]  # out x in: o-proj, qkv, ffn1, ffn2, vocab
ROWS = [1, 4, 32, 128, 768]


def per_call(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--output", default=default_output("linear_kernels"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ratios = {}
    with torch.no_grad():
        for out_features, in_features in SHAPES:
            plain = torch.nn.Linear(in_features, out_features)
            packed = pack_linears(torch.nn.Sequential(torch.nn.Linear(in_features, out_features)), max_rows=max(ROWS))[0]
            packed.load_state_dict(plain.state_dict())
            for rows in ROWS:
                x = torch.randn(rows, 1, in_features)
                torch.testing.assert_close(packed(x), plain(x), rtol=1e-4, atol=1e-4)
                mkl, dnn = [], []
                for _ in range(args.rounds):
                    mkl.append(per_call(lambda: plain(x), args.calls))
                    dnn.append(per_call(lambda: packed(x), args.calls))
                ratios[f"{out_features}x{in_features}", rows] = statistics.median(mkl) / statistics.median(dnn)
    lines = ["| rows | " + " | ".join(f"{o}x{i}" for o, i in SHAPES) + " |", "| ---: |" + " ---: |" * len(SHAPES)]
    for rows in ROWS:
        lines.append(f"| {rows} | " + " | ".join(f"{ratios[f'{o}x{i}', rows]:.2f}x" for o, i in SHAPES) + " |")
    table = "\n".join(lines)
    print(f"plain nn.Linear time / packed time per call ({args.threads} threads, {platform.machine()}):\n")
    print(table)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump({"rounds": args.rounds, "calls": args.calls, **machine(),
                   "ratios": {f"{shape} rows {rows}": value for (shape, rows), value in ratios.items()},
                   "table": table}, handle, indent=2)


if __name__ == "__main__":
    main()
