r"""The attentional RNN decoder of the beam-joint paper (Shankar, Garg & Sarawagi, "Surprisingly Easy Hard-Attention
for Sequence to Sequence Learning", EMNLP 2018, Sec. 2.1 and 4.1): Luong et al. (2015) Sec. 3.1 with input feeding
(Sec. 3.3) on an LSTM cell, as the authors' code (tensorflow/nmt's AttentionWrapper, ``unit_type lstm``).

``rnn_decoder_style="luong"``: the cell reads the previous word and the previous attentional state, and the attention
is queried with the CURRENT state, so P_t(a) (beam-joint Eq. 1) sees y_{t-1}:

    s_t      = RNN([E y_{t-1}; h~_{t-1}], s_{t-1})                      h~_0 = 0
    c_t, a_t = attention(query = s_t, source = h_1..h_S)
    h~_t     = tanh(W_c [s_t; c_t] + b_c)                               (Luong Eq. 5; the decoder's ``readout_proj``)
    P(y_t)   = softmax(lm_head(h~_t))

Beam-joint's candidate for source position a (``beam_joint.py``) is then pure hard attention: h~_{t,a} =
tanh(W_c [s_t; x_a] + b_c), where s_t has seen y_{<t} and the fed soft h~_{<t}, but no soft context of step t.

``rnn_cell="lstm"`` (Hochreiter & Schmidhuber 1997), the paper's cell: torch.nn.LSTMCell's gates [i, f, g, o], its
state kept as one tensor [h; c] per layer (so the cache, beam reordering and checkpointing treat it as the GRU's), the
forget gate's bias initialised to 1 (tensorflow/nmt's ``forget_bias=1.0``; ``hybrid.HybridPreTrainedModel``).

The rest of the RNN decoder (the cells' stacking, the attention functions, the readout, the source pre-computation)
is the hybrid paper's (``hybrid.py``), whose decoder takes this step for ``rnn_decoder_style="luong"`` (also the soft
baseline of the beam-joint paper's setting, a ``hybrid_transformer``).

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import torch
import torch.nn.functional as F

# cache.states names of the two states this step adds after the layers' (see hybrid.py's module docstring)
LUONG_STATE_NAMES = ["luong.feed", "luong.gates"]


def lstm_update(gx, gh, state):
    """LSTM (torch.nn.LSTMCell's gate layout [i, f, g, o]) on the state [h; c]: i, f, o = sig(x + h) of their rows,
    g = tanh(x_g + h_g), c' = f * c + i * g, h' = o * tanh(c') -> [h'; c']."""
    size = state.shape[-1] // 2
    gates = gx + gh
    i, f, g, o = gates.chunk(4, dim=-1)
    cell = torch.sigmoid(f) * state[..., size:] + torch.sigmoid(i) * torch.tanh(g)
    return torch.cat([torch.sigmoid(o) * torch.tanh(cell), cell], dim=-1)


class InputFeedingStep:
    """The Luong step of ``hybrid.HybridDecoder``, which mixes it in and provides the pieces it reads:
    ``layer_updates``, ``output``, ``readout``, ``hidden_projs``, ``context_proj``, ``attention``, ``gates``,
    ``hidden_size``, ``context_size``, ``config``."""

    def input_feeding_states(self, layer_states, mean):
        """The two states this step adds to the layers' initial ones: h~_0 = 0 [B, d_model] and the top layer's
        hidden-side gate pre-activations of s_0 (the fused projection's gate rows, carried to step 1)."""
        gates = self.hidden_projs[-1](self.output(layer_states[-1]))[:, : self.gates * self.hidden_size]
        return [mean.new_zeros(mean.shape[0], self.context_size), gates]

    def luong_step(self, word_input, states, keys, values, mask=None):
        """s_t = RNN([E y_{t-1}; h~_{t-1}], s_{t-1}) (input feeding); c_t, a_t = attention(s_t) (beam-joint Eq. 1 with
        the current state); h~_t = tanh(W_c [s_t; c_t] + b_c). ``states``: the layers' states, h~_{t-1}, the top
        layer's hidden-side gates of s_{t-1}; returns them for step t + 1 (h~_t is ``new_states[-2]``), c_t, a_t."""
        layers, feed, top_gh = states[:-2], states[-2], states[-1]
        gate_rows = self.gates * self.hidden_size
        x = word_input + self.context_proj(F.dropout(feed, self.config.dropout, self.training))
        new_layers = self.layer_updates(x, top_gh, layers)
        current = self.output(new_layers[-1])  # s_t
        fused = self.hidden_projs[-1](current)  # weight combination: the query of step t, the gates of step t + 1
        query = fused[:, gate_rows:] if self.attention.query_size else current
        context, probs = self.attention.attend(query, keys, values, mask)
        attentional = self.readout(current, context)  # h~_t: the output layer's input, fed to step t + 1
        return [*new_layers, attentional, fused[:, :gate_rows]], context, probs


__all__ = ["InputFeedingStep", "LUONG_STATE_NAMES", "lstm_update"]
