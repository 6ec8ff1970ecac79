"""Attention heat maps of one sentence (``hf-hardattn plot``), from the models' ``output_attentions``.

:func:`attention_maps` runs the model teacher-forced on (source, target) -- the target given, or the model's own
greedy translation -- with ``output_attentions=True`` and returns, per layer of the chosen role, the weights that
layer really used ([heads, target, key] as numpy; None for a layer of kind "none" or a GRU layer), with the tokens
for the axes. Row t of a decoder map is the attention while predicting target token t. For the beam-joint models
it also returns the top-K set of the joint layer per target position (P_t(a) = mean over heads of the joint layer's
softmax, top-K = P_t.topk(K), as the model documents).

:func:`plot_layers` draws one model's maps (a row per layer, a column per head and the head mean) and
:func:`plot_comparison` one panel per model (the head mean of one layer each), so soft, hard retrieval (one-hot
rows), Gaussian (fixed bands), recurrent and beam-joint (top-K marked) can be seen side by side.

Tooling (not runtime code): needs matplotlib.
"""

from __future__ import annotations

import os

import torch

from ..registry import ROLES


def joint_layer(model) -> int | None:
    """Index (into ``cross_attentions``) of a beam-joint model's joint layer, None for other models."""
    config = model.config
    if not hasattr(config, "joint_k"):
        return None
    if hasattr(config, "joint_layer_index"):  # Transformer setting
        return config.joint_layer_index()
    return 0  # RNN setting: the GRU decoder's one attention layer


def _joint_k(model) -> int:
    config = model.config
    return config.joint_inference_k or config.joint_k


@torch.no_grad()
def attention_maps(model, tokenizer, source: str, target: str | None = None, role: str = "cross",
                   max_new_tokens: int = 64) -> dict:
    """dict(source_tokens, target_tokens, layers=[np.ndarray [H, Tq, Tk] | None, ...], topk=[Tq, K] | None,
    joint_layer=int | None, target=str). ``target`` None: the model's greedy translation of ``source``."""
    if role not in ROLES:
        raise ValueError(f"`role` must be one of {tuple(ROLES)}, got {role!r}.")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"`source` must be a non-empty sentence, got {source!r}.")
    was_training = model.training
    model.eval()
    batch = tokenizer([source], return_tensors="pt").to(model.device)
    start = model.config.decoder_start_token_id
    if target is None:
        generated = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()
        outputs = generated[1:]
        target = tokenizer.decode(outputs, skip_special_tokens=True)
    else:
        outputs = tokenizer(text_target=target)["input_ids"]
    decoder_input_ids = torch.tensor([[start] + outputs[:-1]], device=model.device)
    out = model(**batch, decoder_input_ids=decoder_input_ids, output_attentions=True, return_dict=True)
    model.train(was_training)
    layers = [None if a is None else a[0].float().cpu().numpy() for a in getattr(out, ROLES[role].outputs)]
    if all(layer is None for layer in layers):
        raise ValueError(f"this {type(model).__name__} has no {role} attention weights to plot (every layer of that "
                         f"role is of kind 'none' or a GRU layer); try another `role`.")
    joint = joint_layer(model) if role == "cross" else None
    topk = None
    if joint is not None:
        probs = getattr(out, ROLES[role].outputs)[joint][0].mean(0)  # P_t(a) = mean over heads
        topk = probs.topk(min(_joint_k(model), probs.shape[-1]), dim=-1).indices.cpu().numpy()
    source_tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    target_tokens = tokenizer.convert_ids_to_tokens(outputs)
    key_tokens = target_tokens if role == "decoder" else source_tokens
    query_tokens = source_tokens if role == "encoder" else target_tokens
    def readable(tokens):  # byte-level BPE pieces ("Ġman", "fÃ¤hrt") as the text they stand for ("man", "fährt")
        out = []
        for token in tokens:
            try:
                out.append(tokenizer.convert_tokens_to_string([token]).strip() or token)
            except Exception:  # a tokenizer without convert_tokens_to_string for single tokens
                out.append(token)
        return [printable(label) for label in out]

    return dict(source_tokens=key_tokens, target_tokens=query_tokens, source_labels=readable(key_tokens),
                target_labels=readable(query_tokens), layers=layers, topk=topk, joint_layer=joint, target=target,
                role=role)


def printable(label: str) -> str:
    """An axis label with its control characters written as escapes (``\\x05``): a byte-level piece of a multi-byte
    character (or of an untrained model's output) decodes to one, which no font has a glyph for."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in label)


def _draw(axis, matrix, maps, topk=None, title=None, labels=True):
    image = axis.imshow(matrix, vmin=0.0, vmax=max(1e-9, float(matrix.max())), cmap="viridis", aspect="auto",
                        interpolation="nearest")
    rows, columns = matrix.shape
    if labels and rows == len(maps["target_tokens"]) and columns == len(maps["source_tokens"]):
        axis.set_xticks(range(columns), maps["source_labels"], rotation=90, fontsize=7)
        axis.set_yticks(range(rows), maps["target_labels"], fontsize=7)
    else:  # e.g. beam-joint Transformer's candidate rows after the joint layer
        axis.set_xticks([])
        axis.set_yticks([])
    if topk is not None and rows == topk.shape[0]:
        for t, indices in enumerate(topk):
            axis.scatter(indices, [t] * len(indices), marker="s", s=30, facecolors="none", edgecolors="red",
                         linewidths=1.0)
    if title:
        axis.set_title(title, fontsize=8)
    return image


def plot_layers(maps: dict, path: str, title: str = "") -> str:
    """One PNG: a row per layer (None layers skipped), a column per head plus the head mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(i, layer) for i, layer in enumerate(maps["layers"]) if layer is not None]
    heads = max(layer.shape[0] for _, layer in present)
    figure, axes = plt.subplots(len(present), heads + 1, figsize=(2.2 * (heads + 1), 2.2 * len(present)),
                                squeeze=False)
    for row, (index, layer) in enumerate(present):
        topk = maps["topk"] if index == maps["joint_layer"] else None
        for head in range(heads + 1):
            axis = axes[row][head]
            if head < layer.shape[0]:
                _draw(axis, layer[head], maps, topk, f"layer {index} head {head}", labels=head == 0)
            elif head == heads:
                _draw(axis, layer.mean(0), maps, topk, f"layer {index} mean", labels=False)
            else:
                axis.axis("off")
    figure.suptitle(title or f"{maps['role']} attention", fontsize=9)
    figure.tight_layout()
    _save(figure, path)
    return path


def plot_comparison(named_maps: list, path: str, layer: int = -1) -> str:
    """One PNG, one panel per (name, maps): the head mean of each model's ``layer``-th present layer (default the
    last; a beam-joint model shows its joint layer with the top-K set marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(named_maps), figsize=(3.2 * len(named_maps), 3.4), squeeze=False)
    for axis, (name, maps) in zip(axes[0], named_maps):
        present = [(i, m) for i, m in enumerate(maps["layers"]) if m is not None]
        index, matrix = present[layer] if maps["joint_layer"] is None else (
            maps["joint_layer"], maps["layers"][maps["joint_layer"]])
        topk = maps["topk"] if index == maps["joint_layer"] else None
        _draw(axis, matrix.mean(0), maps, topk, f"{name} (layer {index}, head mean)")
    figure.tight_layout()
    _save(figure, path)
    return path


def _save(figure, path):
    import matplotlib.pyplot as plt

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
