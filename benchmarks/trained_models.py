"""Shared by the benchmarks that read models trained by ``benchmarks/reproduce.py`` (``decode_lengths.py``,
``grouped_memory.py``): their argument checks."""

import os

import torch


def check_trained_args(parser, args, positive):
    """Stops through ``parser`` when an option named in ``positive`` is below 1 or a row of ``args.models`` has no
    trained model under ``args.folder``/models; then sets torch's threads to ``args.threads``."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    missing = [m for m in args.models if not os.path.isdir(os.path.join(args.folder, "models", m))]
    if missing:
        parser.error(f"no trained model for {missing} under {args.folder}/models; run benchmarks/reproduce.py first")
    torch.set_num_threads(args.threads)
