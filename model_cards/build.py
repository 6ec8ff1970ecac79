"""Write the model card of every hf_hardattn model type (at its default, paper-base size) into this folder.

The same text is written next to the weights by ``save_pretrained`` (hf_hardattn/model_card.py); a trained model's
card adds its measured results (``hardattn_results.json`` in the saved folder). Here each card also shows the rows of
the reproduction tables (``benchmarks/results/reproduce_*.json``, written by ``benchmarks/reproduce.py``) for its
model type, next to the soft baseline and the MarianMTModel reference.

    python model_cards/build.py
"""

import glob
import json
import os

import torch

import hf_hardattn
from hf_hardattn.model_card import render_model_card
from hf_hardattn.reproduce import row_table

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
REFERENCE_ROWS = ("marian", "soft")
# the baseline a model type's paper compares against, where it is not the soft Transformer
BASELINE_ROWS = {"beam_joint_rnn": ("hybrid_additive", "rnn_luong_soft")}  # soft on each row's RNN decoder


def reproduction_tables(model_type):
    parts = []
    # the main tables, then runs of the same script kept in sub-folders (e.g. multi30k_1500_steps: equal steps)
    paths = sorted(glob.glob(os.path.join(RESULTS, "reproduce_*_*.json")))
    paths += sorted(glob.glob(os.path.join(RESULTS, "*", "reproduce_*_*.json")))
    for path in paths:
        with open(path) as handle:
            payload = json.load(handle)
        if payload["preset"] == "tiny":
            continue
        rows = {name: row for name, row in payload["rows"].items()
                if row["model_type"] == model_type or name in REFERENCE_ROWS + BASELINE_ROWS.get(model_type, ())}
        if any(row["model_type"] == model_type for row in rows.values()):
            folder = os.path.dirname(path)
            run = "" if folder == RESULTS else f", run `{os.path.basename(folder)}`"
            parts.append(f"{payload['task']}, preset `{payload['preset']}`{run} ({payload['test_examples']} test "
                         f"examples; command per row in `{os.path.relpath(path, os.path.dirname(RESULTS))}`):\n\n"
                         + row_table(payload["task"], payload["preset"], rows))
    if not parts:
        return ""
    return ("A task's score is measured the same way in each of its tables (same test set, same scoring); the "
            "tables differ in training budget (minutes or steps) and precision. Training minutes and sentences/s "
            "compare only between rows run on the same machine in one session: the rows of one table may come from "
            "different sessions and CPUs (each row's JSON stores its command and, since 2026-11-23, its `machine`)."
            "\n\n" + "\n\n".join(parts))


def main():
    folder = os.path.dirname(os.path.abspath(__file__))
    for config_class, model_class in hf_hardattn.MODEL_CLASSES.items():
        with torch.device("meta"):  # the card needs the architecture and parameter count, not weights
            model = model_class(config_class())
        tables = reproduction_tables(config_class.model_type)
        path = os.path.join(folder, f"{config_class.model_type}.md")
        with open(path, "w") as handle:
            handle.write(render_model_card(model, {"table": tables} if tables else None))
        print("wrote", path)


if __name__ == "__main__":
    main()
