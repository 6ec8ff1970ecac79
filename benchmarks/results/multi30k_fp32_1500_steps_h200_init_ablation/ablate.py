"""Soft vs MarianMTModel at equal steps: which difference makes Marian learn faster per step? Extra rows of
benchmarks/reproduce.py (same recipe), differing from `soft` / `marian` in the initialisation only.

    python benchmarks/results/multi30k_fp32_1500_steps_h200_init_ablation/ablate.py --task multi30k --preset cpu \
        --rows soft_marian_init ... (reproduce's arguments; run3.sh: how the GPU call of 2026-11-26 ran them)
"""
import sys

import torch

from hf_hardattn.tools import reproduce as R


def reinit(model, std=None, linears=True, embeddings=True):
    """std given: N(0, std) (Marian's init, std 0.02); None: ours (Xavier-uniform linears, N(0, d^-1/2) embeddings)."""
    d = model.config.d_model
    tied = model.get_input_embeddings().weight.data_ptr()  # the output layer shares it: an embedding, not a linear
    for module in model.modules():
        if type(module).__name__ == "MarianSinusoidalPositionalEmbedding":
            continue
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() == tied:
            continue
        if isinstance(module, torch.nn.Linear) and linears:
            if std is None:
                torch.nn.init.xavier_uniform_(module.weight)
            else:
                torch.nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding) and embeddings:
            torch.nn.init.normal_(module.weight, 0.0, d**-0.5 if std is None else std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
    return model


def variant(base, **kw):
    return lambda ctx: reinit(base(ctx), **kw)


R.ROWS += [
    R.Row("soft_marian_init", "ablation", "soft with Marian's init (every linear and embedding N(0, 0.02))",
          build=variant(R._soft(), std=0.02)),
    R.Row("soft_marian_emb", "ablation", "soft with Marian's embedding init only (N(0, 0.02))",
          build=variant(R._soft(), std=0.02, linears=False)),
    R.Row("soft_marian_lin", "ablation", "soft with Marian's linear init only (N(0, 0.02))",
          build=variant(R._soft(), std=0.02, embeddings=False)),
    R.Row("marian_our_init", "ablation", "Marian with our init (Xavier linears, N(0, d^-1/2) embeddings)",
          build=variant(R._marian, std=None)),
]

if __name__ == "__main__":
    sys.exit(R.main(sys.argv[1:]))
