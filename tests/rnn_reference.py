"""An attentional RNN decoder written independently of ``hf_hardattn.hybrid.HybridDecoder``, from the raw parameters of
a hybrid / beam-joint RNN model, for the tests of both (float64).

The cells are torch.nn.LSTMCell / torch.nn.GRUCell loaded with the model's gate rows (W_ih = [W_e | W_v] with v the
context (bahdanau) or the fed attentional state (luong), W_hh = the gate rows of the hidden projection), the attention
is written per equation (additive / dot; no fused projections, no pre-computed keys, no carried gates), and the
beam-joint candidates are built from their definition:

    bahdanau: a_t = attention(s_{t-1}), c_t = sum_j a_tj x_j, s_t = cell([E y_{t-1}; c_t], s_{t-1}),
              out_t = tanh(W_o [s_t; c_t] + b_o), candidate_a = tanh(W_o [s_t; x_a] + b_o)
    luong:    s_t = cell([E y_{t-1}; h~_{t-1}], s_{t-1}), h~_0 = 0, a_t = attention(s_t), c_t = sum_j a_tj x_j,
              h~_t = tanh(W_c [s_t; c_t] + b_c) (= out_t), candidate_a = tanh(W_c [s_t; x_a] + b_c)

s_0 = tanh(W_init mean_j x_j + b) per layer (masked mean), an LSTM's memory cell c_0 = 0.
"""

import math

import torch


def naive_rnn_decoder(model, ids, mask, dec):
    """Runs ``model``'s encoder, then the decoder above over ``dec`` (teacher forcing). Returns a dict of float tensors
    in the model's dtype: ``states`` [B, T, H] (top layer's h), ``cells`` [B, T, L, H] (LSTM memory, zeros for a
    GRU), ``probs`` [B, T, S], ``contexts`` [B, T, d], ``readout`` [B, T, d], ``log_probs`` [B, T, V] (soft output),
    ``candidates`` [B, T, S, d] (the output-layer input with hard attention on each source position) and
    ``candidate_log_probs`` [B, T, S, V]."""
    config = model.config
    assert config.rnn_attention in ("additive", "dot"), "the reference writes out additive and dot attention only"
    assert config.embedding_size == config.d_model
    decoder = model.model.decoder
    raw = {name: param for name, param in decoder.named_parameters()}
    lstm, luong = config.rnn_cell == "lstm", config.rnn_decoder_style == "luong"
    hidden, layers, d = config.rnn_hidden_size, config.decoder_layers, config.d_model
    gate_rows = (4 if lstm else 3) * hidden
    memory = model.model.encoder(ids, mask).last_hidden_state  # [B, S, d]
    batch, length, _ = memory.shape
    visible = mask.bool()
    dtype = memory.dtype

    cells = [(torch.nn.LSTMCell if lstm else torch.nn.GRUCell)(2 * d if layer == 0 else hidden, hidden,
                                                                 device="meta") for layer in range(layers)]

    def run_cell(layer, x, h, c):
        """torch's own cell, called with the model's tensors as its parameters (gradients reach the model)."""
        w_ih = raw[f"input_projs.{layer}.weight"]
        if layer == 0:  # [W_e | W_v]: the word part and the context / fed-state part
            w_ih = torch.cat([w_ih, raw["context_proj.weight"]], 1)
        params = {"weight_ih": w_ih, "bias_ih": raw[f"input_projs.{layer}.bias"],
                  "weight_hh": raw[f"hidden_projs.{layer}.weight"][:gate_rows],
                  "bias_hh": raw[f"hidden_projs.{layer}.bias"][:gate_rows]}
        if lstm:
            return torch.func.functional_call(cells[layer], params, (x, (h, c)))
        return torch.func.functional_call(cells[layer], params, (x, h)), c

    def attention(query_state):
        """a [B, S], c [B, d] for the query state [B, H], one source position at a time."""
        scores = torch.empty(batch, length, dtype=dtype)
        for j in range(length):
            if config.rnn_attention == "dot":
                key = memory[:, j] @ raw["attention.key_proj.weight"].T  # W_k x_j  [B, H]
                scores[:, j] = (query_state * key).sum(-1) / math.sqrt(hidden)
            else:
                w_a = raw[f"hidden_projs.{layers - 1}.weight"][gate_rows:]
                b_a = raw[f"hidden_projs.{layers - 1}.bias"][gate_rows:]
                e = torch.tanh(query_state @ w_a.T + b_a + memory[:, j] @ raw["attention.key_proj.weight"].T)
                scores[:, j] = e @ raw["attention.score.weight"][0]
        scores = scores.masked_fill(~visible, float("-inf"))
        a = torch.softmax(scores, -1)
        return a, sum(a[:, j, None] * memory[:, j] for j in range(length))

    def output_layer(state, context):
        return torch.tanh(torch.cat([state, context], -1) @ raw["readout_proj.weight"].T + raw["readout_proj.bias"])

    weights = visible.to(dtype)[..., None]
    mean = (memory * weights).sum(1) / weights.sum(1)
    init = torch.tanh(mean @ raw["init_proj.weight"].T + raw["init_proj.bias"])
    h = [init[:, layer * hidden : (layer + 1) * hidden] for layer in range(layers)]
    c = [torch.zeros_like(state) for state in h]
    feed = torch.zeros(batch, d, dtype=dtype)
    shared = model.model.shared  # its padding row gets no gradient (nn.Embedding's padding_idx)
    embeddings = torch.nn.functional.embedding(dec, shared.weight, shared.padding_idx)
    embeddings = embeddings * (math.sqrt(d) if config.scale_embedding else 1.0)
    lm_head = model.lm_head.weight
    out = {key: [] for key in ("states", "cells", "probs", "contexts", "readout", "candidates")}
    for t in range(dec.shape[1]):
        if luong:
            x = torch.cat([embeddings[:, t], feed], -1)
        else:
            a, context = attention(h[-1])  # s_{t-1}
            x = torch.cat([embeddings[:, t], context], -1)
        for layer in range(layers):
            h[layer], c[layer] = run_cell(layer, x if layer == 0 else h[layer - 1], h[layer], c[layer])
        if luong:
            a, context = attention(h[-1])  # s_t
        readout = output_layer(h[-1], context)
        feed = readout
        out["states"].append(h[-1])
        out["cells"].append(torch.stack(c, 1))
        out["probs"].append(a)
        out["contexts"].append(context)
        out["readout"].append(readout)
        out["candidates"].append(torch.stack([output_layer(h[-1], memory[:, j]) for j in range(length)], 1))
    result = {key: torch.stack(value, 1) for key, value in out.items()}
    result["log_probs"] = (result["readout"] @ lm_head.T).log_softmax(-1)
    result["candidate_log_probs"] = (result["candidates"] @ lm_head.T).log_softmax(-1)
    return result
