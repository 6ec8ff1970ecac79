"""``hf-hardattn plot`` / hf_hardattn.tools.plot: the plotted matrices are the model's own output_attentions of the same
teacher-forced pass (computed here independently), beam-joint's boxed set is the top-K of the head-mean joint
weights, and the PNG files are written with one panel per layer and head."""

import os

import matplotlib
import matplotlib.image
import numpy as np
import pytest
import torch

from common import contract_model, toy_tokenizer
from hf_hardattn.tools.plot import attention_maps, plot_comparison, plot_layers
from hf_hardattn_cli.command import main

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
    with torch.no_grad():  # the weights of the pass teacher-forced on that translation
        want = model(**ids, decoder_input_ids=torch.tensor([generated[:-1]]), output_attentions=True)
    for got, layer in zip(maps["layers"], want.decoder_attentions, strict=True):
        assert torch.allclose(torch.from_numpy(got), layer[0].float(), atol=1e-6)


def read_panels(figure, path):
    """What each heat-map panel of the PNG at ``path`` shows, read back from its pixels: {title: (values, boxed)}.
    ``values`` [rows, columns]: each cell's centre pixel, which must be a colour of the viridis table (8-bit, to the
    drawing's rounding of 1-2 levels), as the fraction of the panel's colour scale (0 .. vmax) that the nearest table
    colour stands for, (its index + 0.5) / 256; ``boxed``: whether a red top-K square is drawn around the cell (red
    pixels within 7 px of its centre; viridis has no red). The cells' positions come from ``figure``'s axes (figure
    fractions, independent of the dpi)."""
    table = matplotlib.colormaps["viridis"](np.arange(256), bytes=True)[:, :3].astype(int)
    image = np.round(matplotlib.image.imread(path)[..., :3] * 255).astype(int)
    height, width = image.shape[:2]
    panels = {}
    for axis in figure.axes:
        if not axis.images:
            continue
        rows, columns = axis.images[0].get_array().shape
        x0, y0, w, h = axis.get_position().bounds
        (left, right), (bottom, top) = axis.get_xlim(), axis.get_ylim()
        values, boxed = np.zeros((rows, columns)), np.zeros((rows, columns), dtype=bool)
        for t in range(rows):
            for k in range(columns):
                y = int((1 - y0 - h * (t - bottom) / (top - bottom)) * height)
                x = int((x0 + w * (k - left) / (right - left)) * width)
                distance = np.abs(table - image[y, x]).max(1)
                assert distance.min() <= 2, (axis.get_title(), t, k, image[y, x])  # a heat-map colour
                values[t, k] = (distance.argmin() + 0.5) / 256
                around = image[y - 7 : y + 8, x - 7 : x + 8]
                boxed[t, k] = ((around[..., 0] > 150) & (around[..., 1] < 80) & (around[..., 2] < 80)).any()
        panels[axis.get_title()] = values, boxed
    return panels


def assert_shows(values, matrix):
    """The panel's colours are ``matrix`` on a 0 .. max scale, to 2/256 of the scale: the table's step of 1/256, and
    neighbouring viridis entries differ by 1-2 levels per channel, as much as the drawing's rounding, so the colour
    read back is the value's entry or a neighbour. The matrix varies: a blank or uniform panel would not pass."""
    scaled = matrix / matrix.max()
    assert scaled.max() - scaled.min() > 0.1, matrix
    assert np.abs(values - scaled).max() <= 2 / 256, (values, scaled)


def assert_grid(panels, layers):
    """Every panel of a plot_layers grid shows its head of ``layers`` (None: a layer without weights, not drawn), the
    last panel of each row the head mean."""
    present = [(index, layer) for index, layer in enumerate(layers) if layer is not None]
    assert len(panels) == sum(layer.shape[0] + 1 for _, layer in present)
    for index, layer in present:
        for head in range(layer.shape[0]):
            assert_shows(panels[f"layer {index} head {head}"][0], layer[head])
        assert_shows(panels[f"layer {index} mean"][0], layer.mean(0))


def record_figures(monkeypatch):
    """{path: figure} of every PNG that hf_hardattn.tools.plot writes from now on."""
    import hf_hardattn.tools.plot

    figures = {}
    save = hf_hardattn.tools.plot._save
    monkeypatch.setattr(hf_hardattn.tools.plot, "_save",
                        lambda figure, path: (figures.__setitem__(os.path.abspath(path), figure), save(figure, path)))
    return figures


def test_png_grid_and_comparison(tmp_path, monkeypatch):
    """The PNGs show the model's attention weights: every panel of the grid (layer x head, and the head mean) and of
    the comparison, read back from the file's pixels, is the matrix of the model's own output_attentions of the same
    pass (computed here); beam-joint's red boxes mark exactly the top-K cells of its joint layer."""
    figures = record_figures(monkeypatch)
    tok = toy_tokenizer()
    models = {kind: contract_model(kind) for kind in ("soft", "beam_joint_rnn")}
    named = [(kind, attention_maps(model, tok, SOURCE, TARGET)) for kind, model in models.items()]
    want = {kind: [layer[0].numpy() for layer in reference(model, tok, "cross")[0]] for kind, model in models.items()}
    path = plot_layers(named[0][1], str(tmp_path / "soft.png"))
    image = matplotlib.image.imread(path)
    heads, layers = named[0][1]["layers"][0].shape[0], len(named[0][1]["layers"])
    ratio = image.shape[1] / image.shape[0]  # a grid of layers x (heads + mean) panels of one size
    assert abs(ratio - (heads + 1) / layers) < 0.15 * (heads + 1) / layers, (ratio, heads, layers)
    panels = read_panels(figures[os.path.abspath(path)], path)
    assert_grid(panels, want["soft"])
    assert not any(boxed.any() for _, boxed in panels.values())
    path = plot_comparison(named, str(tmp_path / "both.png"))
    assert matplotlib.image.imread(path).shape[1] > 1.5 * matplotlib.image.imread(path).shape[0]
    panels = read_panels(figures[os.path.abspath(path)], path)
    values, boxed = panels[f"soft (layer {layers - 1}, head mean)"]
    assert_shows(values, want["soft"][-1].mean(0))
    assert not boxed.any()
    joint = named[1][1]["joint_layer"]
    values, boxed = panels[f"beam_joint_rnn (layer {joint}, head mean)"]
    probs = want["beam_joint_rnn"][joint].mean(0)
    assert_shows(values, probs)
    k = models["beam_joint_rnn"].config.joint_inference_k or models["beam_joint_rnn"].config.joint_k
    assert 0 < k < probs.shape[1]  # some cells boxed, some not
    for t in range(probs.shape[0]):  # the boxed cells of row t: K of them, its most probable source positions
        assert boxed[t].sum() == k and probs[t][boxed[t]].min() >= probs[t][~boxed[t]].max(), (t, boxed[t], probs[t])


def test_cli_writes_one_file_per_model_and_a_comparison(tmp_path, capsys, monkeypatch):
    """One PNG per model and role plus a comparison, each showing that saved model's weights (read back from the
    pixels: hard retrieval's one-hot cross-attention, soft's encoder self-attention); errors are one line, status 2."""
    figures = record_figures(monkeypatch)
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
    for kind, role in (("hard_retrieval", "cross"), ("soft", "encoder")):
        path = str(out / f"{kind}_{role}.png")
        want = [None if layer is None else layer[0].numpy() for layer in reference(contract_model(kind), tok, role)[0]]
        assert_grid(read_panels(figures[os.path.abspath(path)], path), want)
    # errors: one line, exit status 2
    assert main(["plot", *folders, "--source", SOURCE, "--names", "a", "--out", str(out)]) == 2
    assert "--names gives 1 names for 2 models" in capsys.readouterr().err
    hybrid = tmp_path / "hybrid"
    contract_model("hybrid_additive").save_pretrained(hybrid, tokenizer=tok)
    assert main(["plot", str(hybrid), "--source", SOURCE, "--role", "decoder", "--out", str(out)]) == 2
    assert "no decoder attention weights to plot" in capsys.readouterr().err.splitlines()[-1]
    assert main(["plot", str(hybrid), "--source", " ", "--out", str(out)]) == 2
    assert "`source` must be a non-empty sentence" in capsys.readouterr().err
