"""``hf-hardattn plot`` / hf_hardattn.plot: the plotted matrices are the model's own output_attentions of the same
teacher-forced pass (computed here independently), beam-joint's boxed set is the top-K of the head-mean joint
weights, and the PNG files are written with one panel per layer and head."""

import os

import matplotlib.image
import pytest
import torch

from common import contract_model, toy_tokenizer
from hf_hardattn.cli import main
from hf_hardattn.plot import attention_maps, plot_comparison, plot_layers

os.environ["HF_HUB_OFFLINE"] = "1"
SOURCE = "t5 t9 t7 t12 t6"
TARGET = "t6 t12 t7 t9 t5"
KINDS = ["soft", "hard_retrieval", "gaussian_sh_x", "recurrent_expand_1", "hybrid_additive",
         "beam_joint_transformer", "beam_joint_rnn"]


def reference(model, tok, role):
    """The same pass written out: decoder input = start + target tokens (without the final EOS)."""
    ids = tok([SOURCE], return_tensors="pt")
    labels = tok(text_target=TARGET)["input_ids"]
    decoder = torch.tensor([[model.config.decoder_start_token_id] + labels[:-1]])
    with torch.no_grad():
        out = model.eval()(**ids, decoder_input_ids=decoder, output_attentions=True)
    return getattr(out, f"{role}_attentions"), labels


@pytest.mark.parametrize("kind", KINDS)
def test_maps_are_the_models_attention_weights(kind):
    model, tok = contract_model(kind), toy_tokenizer()
    maps = attention_maps(model, tok, SOURCE, TARGET, role="cross")
    want, labels = reference(model, tok, "cross")
    assert len(maps["layers"]) == len(want)
    for got, layer in zip(maps["layers"], want):
        assert (got is None) == (layer is None)
        if layer is not None:
            assert torch.allclose(torch.from_numpy(got), layer[0].float(), atol=1e-6)
    assert maps["target_tokens"] == tok.convert_ids_to_tokens(labels)
    assert maps["source_tokens"] == tok.convert_ids_to_tokens(tok(SOURCE)["input_ids"])
    if kind.startswith("beam_joint"):
        joint = maps["joint_layer"]
        probs = want[joint][0].mean(0)
        k = model.config.joint_inference_k or model.config.joint_k
        assert maps["topk"].shape == (len(labels), k)
        for t in range(len(labels)):  # the boxed set: the K most probable source positions of row t
            chosen = set(maps["topk"][t].tolist())
            outside = [p for p in range(probs.shape[1]) if p not in chosen]
            assert min(probs[t, list(chosen)]) >= max(probs[t, outside])
    else:
        assert maps["topk"] is None and maps["joint_layer"] is None
    if kind == "hard_retrieval":  # one-hot rows
        assert all(((layer == 0) | (layer == 1)).all() and (layer.sum(-1) == 1).all() for layer in maps["layers"])


def test_greedy_target_when_none_given():
    model, tok = contract_model("soft"), toy_tokenizer()
    ids = tok([SOURCE], return_tensors="pt")
    generated = model.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=20)[0].tolist()
    maps = attention_maps(model, tok, SOURCE, None, role="decoder", max_new_tokens=20)
    assert maps["target_tokens"] == tok.convert_ids_to_tokens(generated[1:])
    assert maps["layers"][0].shape[1:] == (len(generated) - 1, len(generated) - 1)  # decoder self-attention
    assert all((layer[:, 0, 1:] == 0).all() for layer in maps["layers"])  # causal


def test_png_grid_and_comparison(tmp_path):
    tok = toy_tokenizer()
    named = [(kind, attention_maps(contract_model(kind), tok, SOURCE, TARGET)) for kind in ("soft", "beam_joint_rnn")]
    path = plot_layers(named[0][1], str(tmp_path / "soft.png"))
    image = matplotlib.image.imread(path)
    heads, layers = named[0][1]["layers"][0].shape[0], len(named[0][1]["layers"])
    ratio = image.shape[1] / image.shape[0]  # a grid of layers x (heads + mean) panels of one size
    assert abs(ratio - (heads + 1) / layers) < 0.15 * (heads + 1) / layers, (ratio, heads, layers)
    path = plot_comparison(named, str(tmp_path / "both.png"))
    assert matplotlib.image.imread(path).shape[1] > 1.5 * matplotlib.image.imread(path).shape[0]


def test_cli_writes_one_file_per_model_and_a_comparison(tmp_path, capsys):
    tok = toy_tokenizer()
    folders = []
    for kind in ("soft", "hard_retrieval"):
        folder = tmp_path / kind
        contract_model(kind).save_pretrained(folder, tokenizer=tok)
        folders.append(str(folder))
    out = tmp_path / "plots"
    assert main(["plot", *folders, "--source", SOURCE, "--target", TARGET, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["comparison_cross.png", "hard_retrieval_cross.png", "soft_cross.png"]
    assert main(["plot", folders[0], "--source", SOURCE, "--role", "encoder", "--out", str(out)]) == 0
    assert (out / "soft_encoder.png").exists()
    # errors: one line, exit status 2
    assert main(["plot", *folders, "--source", SOURCE, "--names", "a", "--out", str(out)]) == 2
    assert "--names gives 1 names for 2 models" in capsys.readouterr().err
    hybrid = tmp_path / "hybrid"
    contract_model("hybrid_additive").save_pretrained(hybrid, tokenizer=tok)
    assert main(["plot", str(hybrid), "--source", SOURCE, "--role", "decoder", "--out", str(out)]) == 2
    assert "no decoder attention weights to plot" in capsys.readouterr().err.splitlines()[-1]
    assert main(["plot", str(hybrid), "--source", " ", "--out", str(out)]) == 2
    assert "`source` must be a non-empty sentence" in capsys.readouterr().err
