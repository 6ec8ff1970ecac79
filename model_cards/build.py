"""Write the model card of every hf_hardattn model type (at its default, paper-base size) into this folder.

The same text is written next to the weights by ``save_pretrained`` (hf_hardattn/model_card.py); a trained model's
card adds its measured results (``hardattn_results.json`` in the saved folder).

    python model_cards/build.py
"""

import os

import torch

import hf_hardattn
from hf_hardattn.model_card import render_model_card


def main():
    folder = os.path.dirname(os.path.abspath(__file__))
    for config_class, model_class in hf_hardattn.MODEL_CLASSES.items():
        with torch.device("meta"):  # the card needs the architecture and parameter count, not weights
            model = model_class(config_class())
        path = os.path.join(folder, f"{config_class.model_type}.md")
        with open(path, "w") as handle:
            handle.write(render_model_card(model))
        print("wrote", path)


if __name__ == "__main__":
    main()
