"""The papers' tables on real data, one row per variant, one shared recipe (see hf_hardattn/tools/reproduce.py).

    python benchmarks/reproduce.py --task multi30k --preset cpu              # all rows, 35 min each, resumable
    python benchmarks/reproduce.py --task multi30k --preset cpu --rows marian soft
    python benchmarks/reproduce.py --task nouns --preset cpu                 # 3 min per row
    python benchmarks/reproduce.py --task multi30k --preset base             # Transformer-base, for a GPU
    python benchmarks/reproduce.py --task multi30k --preset cpu --recipe hard_retrieval \
        --rows soft hard_cross hard_self_cross --seed 1 --output-dir outputs/reproduce/paper_hard_retrieval_s1
        # a paper's recipe (hard_retrieval, hybrid, beam_joint), to convergence; commands: benchmarks/README.md

The same entry point is ``hf-hardattn reproduce``. Results: outputs/reproduce/TASK-PRESET/ (models with their
cards, KD data, results) and, unless --output-dir is given, benchmarks/results/reproduce_TASK_PRESET.{json,md}
(reproduce_TASK_PRESET_RECIPE.* under a paper's recipe).
"""

import os
import sys

from hf_hardattn.tools.reproduce import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    # the tables here are the default output folder's; a run elsewhere (--output-dir) does not overwrite them
    if not any(a.startswith(("--results-dir", "--output-dir")) for a in argv):
        argv += ["--results-dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    sys.exit(main(argv))
