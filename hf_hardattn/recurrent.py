"""Recurrent cross-attention (Rosendahl, Herold, Petrick, Ney: "Recurrent Attention for the Transformer").

The encoder-decoder attention of decoder layer l gets an explicit dependency on its own previous step i-1, per head
n. One config field, ``recurrent_variant``, selects one of the paper's nine variants:

* modify the query (Sec. 3.2): concatenate to the query input s_i a function f_{i-1} of the previous step:
  ``concat_context`` f = c_{i-1}^{l,n} (Eq. 2), ``concat_weight`` f = alpha_{i-1,j} (Eq. 3),
  ``concat_accumulated`` f = sum_{i'<i} alpha_{i',j} (Eq. 4). With W_q' = [W_q | W_f] the energy splits into the
  standard energy plus one extra term, k_j . (W_f f) / sqrt(d_k); for Eq. 3/4, f is a scalar per source position j,
  so the extra term is f_j * (k_j . w_f) / sqrt(d_k) and no query is materialised per source position;
* expand the key-value list (Sec. 3.3) by one pair (g_k, g_v) appended after the J source positions:
  ``expand_1`` shared W_k/W_v on the full previous context c_{i-1}^l (Eq. 5), ``expand_2`` separate matrices on
  c_{i-1}^l (Eq. 6), ``expand_3`` separate per-head matrices on the head's own context c_{i-1}^{l,n} (Eq. 7),
  ``expand_4`` key transformed, value = c_{i-1}^{l,n} untransformed (Eq. 8);
* re-scale the energies (Sec. 3.4): ``continuity`` (Eq. 9, recursive in the re-scaled energies, window k, lambda)
  and ``coverage`` (Eq. 10, minus lambda / sqrt(d_k) times the accumulated weights), then softmax (Eq. 11).

Conventions: the "previous" quantities at the first target position are zeros (so Eq. 5/6 give g = W 0, i.e. the
projections' biases); padded source positions get weight 0, are excluded from Eq. 9's window sums (like positions
beyond the sentence ends, with the divisor kept at 2k+1) and add 0 to the accumulated weights; the per-layer,
per-head state lives in ``HardAttnCache.states`` (keys ``recurrent.{layer}.{name}``) so beam search reorders it.
Target padding on the right (collators, generate()) comes after every real position, so it never feeds a real one. A
left-padded decoder prompt (padding before a row's first token, ``decoder_attention_mask``; the decoder passes each
row's count as ``decoder_padding``): a padded step leaves the state as it was, so the row's first real token reads the
zeros above and no padded step adds to a context or an accumulated weight; the row decodes as its prompt alone.
With attention dropout, the dropped weights form the context (and hence a context state); the weight states
(Eq. 3, 4, 10) use the weights before dropout.

Training speed: the recurrence is inside one layer only (alpha_i^l depends on s_i^l and on layer l's own step
i-1), and s_i^l depends on lower layers only, so the skeleton's layer-by-layer decoder is kept as is: self-attention,
FFN, the query/key/value projections and q K^T are computed for all positions at once, and just the cheap recurrent
part of each step (a few [B, H, J] operations) runs in a loop over target positions. The loop body is
:meth:`RecurrentCrossAttention.step`, which also serves cached decoding (one position per call).

Runtime code shipped with saved models (``trust_remote_code``): flat, same-folder relative imports only.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init

from .configuration_hardattn import HardAttnConfig
from .inputs import is_tracing
from .layers import SoftAttention
from .modeling_hardattn import HardAttnForConditionalGeneration, HardAttnModel, HardAttnPreTrainedModel
from .registry import KINDS

RECURRENT_VARIANTS = (
    "concat_context", "concat_weight", "concat_accumulated",  # Sec. 3.2, Eq. 2-4
    "expand_1", "expand_2", "expand_3", "expand_4",  # Sec. 3.3, Eq. 5-8
    "continuity", "coverage",  # Sec. 3.4, Eq. 9-11
)
DEFAULTS = KINDS["recurrent"].settings  # its settings and their defaults, in the registry of kinds
CONTEXT_VARIANTS = ("expand_1", "expand_2", "expand_3")  # those that carry the context itself (Eq. 5-7)


def check_recurrent_settings(recurrent_variant, continuity_window, continuity_lambda, coverage_lambda,
                             recurrent_context_norm=False):
    """ValueError naming the field and its allowed values for any bad recurrent setting."""
    if recurrent_variant not in RECURRENT_VARIANTS:
        raise ValueError(f"`recurrent_variant` must be one of {RECURRENT_VARIANTS}, got {recurrent_variant!r}.")
    if not isinstance(recurrent_context_norm, bool):
        raise ValueError(f"`recurrent_context_norm` must be True or False, got {recurrent_context_norm!r}.")
    if recurrent_context_norm and recurrent_variant not in CONTEXT_VARIANTS:
        raise ValueError(f"`recurrent_context_norm`=True normalises the previous context of Eq. 5-7; allowed with "
                         f"`recurrent_variant` in {CONTEXT_VARIANTS}, got {recurrent_variant!r} (its state is a "
                         f"softmax weight or energy and stays bounded).")
    if isinstance(continuity_window, bool) or not isinstance(continuity_window, int) or continuity_window < 0:
        raise ValueError(f"`continuity_window` (k of Eq. 9) must be an integer >= 0, got {continuity_window!r}.")
    number = (int, float)
    if isinstance(continuity_lambda, bool) or not isinstance(continuity_lambda, number) or not 0 < continuity_lambda <= 1:
        raise ValueError(f"`continuity_lambda` (lambda of Eq. 9) must be in (0, 1], got {continuity_lambda!r}.")
    if (isinstance(coverage_lambda, bool) or not isinstance(coverage_lambda, number) or not math.isfinite(coverage_lambda)
            or coverage_lambda < 0):
        raise ValueError(f"`coverage_lambda` (lambda of Eq. 10) must be a finite number >= 0, got {coverage_lambda!r}.")


class RecurrentCrossAttention(SoftAttention):
    """Multi-head cross-attention with a recurrent connection to its own previous step (one variant per config).

    Parameters beyond soft attention (q_proj, kv_proj, out_proj):
    ``context_query`` [H, d_k, d_k]: the block of W_q' acting on c_{i-1}^{l,n} (Eq. 2);
    ``weight_query`` [H, d_k]: the column of W_q' acting on alpha_{i-1,j} (Eq. 3) or on the accumulated weight (Eq. 4);
    ``g_proj`` (d -> 2d, no bias): W_gk, W_gv of Eq. 6; ``g_key`` / ``g_value`` [H, d_k, d_k]: W_gk^n / W_gv^n of
    Eq. 7 (``g_key`` only for Eq. 8). Eq. 5, 9 and 10 add none.
    """

    reads_memory_grouped = False  # each beam carries its own previous step (cache.states), one memory row per beam
    # a left-padded decoder prompt: the decoder passes ``decoder_padding``, and a padded step keeps the state (see
    # HardAttnModel.left_padding_refusal and SoftAttention's docstring)
    reads_left_padding = True
    reads_decoder_padding = True

    def __init__(self, config: HardAttnConfig, role: str, layer_idx: int):
        if role != "cross":
            raise ValueError(f"The `recurrent` attention kind is for role 'cross' only; allowed roles: ['cross'], got {role!r}.")
        super().__init__(config, role, layer_idx)
        settings = {name: getattr(config, name, default) for name, default in DEFAULTS.items()}
        check_recurrent_settings(**settings)
        self.variant = settings["recurrent_variant"]
        self.window, self.continuity_lambda = settings["continuity_window"], float(settings["continuity_lambda"])
        self.coverage_lambda = float(settings["coverage_lambda"])
        self.context_norm = settings["recurrent_context_norm"]
        heads, dim, d_model = self.num_heads, self.head_dim, config.d_model
        self.d_model = d_model
        if self.variant == "concat_context":
            self.context_query = nn.Parameter(torch.empty(heads, dim, dim))
        elif self.variant in ("concat_weight", "concat_accumulated"):
            self.weight_query = nn.Parameter(torch.empty(heads, dim))
        elif self.variant == "expand_2":
            self.g_proj = nn.Linear(d_model, 2 * d_model, bias=False)
        elif self.variant in ("expand_3", "expand_4"):
            self.g_key = nn.Parameter(torch.empty(heads, dim, dim))
            if self.variant == "expand_3":
                self.g_value = nn.Parameter(torch.empty(heads, dim, dim))
        self.reset_recurrent_parameters()

    @torch.no_grad()
    def reset_recurrent_parameters(self):
        """Xavier-uniform bounds of the matrices these parameters are blocks of (W_q' is d x (d + extra); the per-head
        W_g^n are d_k x d_k). Uses transformers' init functions, which skip loaded tensors."""
        for name in ("context_query", "g_key", "g_value"):
            if hasattr(self, name):
                bound = math.sqrt(6.0 / (2 * self.head_dim))
                init.uniform_(getattr(self, name), -bound, bound)
        if hasattr(self, "weight_query"):
            bound = math.sqrt(6.0 / (2 * self.d_model + 1))
            init.uniform_(self.weight_query, -bound, bound)

    # -- state ------------------------------------------------------------------------------------------------------
    def state_names(self):
        """The quantities carried from step i-1 to step i."""
        if self.variant in ("expand_1", "expand_2", "expand_3"):
            return ("context",)  # c_{i-1}: full [B, d] for Eq. 5/6, per head [B, H, d_k] for Eq. 7
        return {"concat_context": ("context_weights",),  # c_{i-1}^{l,n} = sum_j w_j v_j, kept as w [B, H, J]
                "expand_4": ("context_weights",),  # same for Eq. 8, where c_{i-1}^{l,n} is a sum of values only
                "concat_weight": ("weights",), "concat_accumulated": ("accumulated",), "coverage": ("accumulated",),
                "continuity": ("energies",)}[self.variant]

    def initial_state(self, batch, source_length, like):
        """Zeros: the "previous" quantities at the first target position."""
        state = {}
        for name in self.state_names():
            if name != "context":
                shape = (batch, self.num_heads, source_length)
            elif self.variant in ("expand_1", "expand_2"):
                shape = (batch, self.d_model)
            else:
                shape = (batch, self.num_heads, self.head_dim)
            state[name] = like.new_zeros(shape)
        return state

    def load_state(self, cache, batch, source_length, like):
        state = self.initial_state(batch, source_length, like)
        if cache is not None:
            for name in state:
                state[name] = cache.states.get(f"recurrent.{self.layer_idx}.{name}", state[name])
        return state

    def store_state(self, cache, state, per_position=None):
        """The state after the call's last position into the cache (its own writes: in place in a static cache);
        ``per_position``: the states after each of the call's positions, kept by the dynamic cache for ``crop``."""
        if cache is not None:
            for name, value in state.items():
                steps = None if per_position is None else [step[name] for step in per_position]
                cache.set_state(f"recurrent.{self.layer_idx}.{name}", value, steps)

    # -- per-forward precomputation -----------------------------------------------------------------------------------
    def previous_pair(self, context):
        """(g_k, g_v) [B, H, d_k] from the previous context (Eq. 5-8); with ``recurrent_context_norm``, from its
        parameter-free layer norm (over d for Eq. 5/6, over each head's d_k for Eq. 7)."""
        batch = context.shape[0]
        if self.context_norm:
            context = F.layer_norm(context, context.shape[-1:])
        if self.variant in ("expand_1", "expand_2"):
            projection = self.kv_proj if self.variant == "expand_1" else self.g_proj  # Eq. 5 / Eq. 6
            g_k, g_v = projection(context).view(batch, 2, self.num_heads, self.head_dim).unbind(1)
            return g_k, g_v
        g_k = torch.einsum("bhe,hde->bhd", context, self.g_key)  # Eq. 7: W_gk^n c_{i-1}^{l,n}, W_gv^n c_{i-1}^{l,n}
        return g_k, torch.einsum("bhe,hde->bhd", context, self.g_value)

    def step(self, energy, query, keys_extra, values, valid, state):
        """One target position: ``energy`` = the masked standard energies hat-alpha_i [B, H, J] (-inf at padding; raw and
        unmasked for ``continuity``), ``query`` q_i [B, H, d_k] (for ``expand_4``: q_i W_gk V^T / sqrt(d_k) [B, H, J]),
        ``keys_extra`` the per-forward precomputation of Eq. 2-4, ``values`` [B, H, J, d_k], ``valid`` [B, 1, J] float
        or None, ``state`` from step i-1.

        Returns (out, new state, weights): out is the per-head context c_i^{l,n} [B, H, d_k] for Eq. 7, the full context
        c_i^l [B, d] for Eq. 5/6, and otherwise weights over the values [B, H, J] (re-scaled energies for
        ``continuity``), whose contexts are formed for all positions at once after the loop; weights is what the
        expand variants (Eq. 5-8) attended with, [B, H, J + 1] over the expanded key-value list (dropout applied), and
        None for the others (their weights are ``out``). Eq. 2 and 8 only ever use the previous
        context through V, so their state is the weights w with c_{i-1}^{l,n} = sum_j w_j v_j (exact, and the loop
        never touches V)."""
        variant, scale = self.variant, self.head_dim**-0.5
        if variant == "continuity":  # Eq. 9: recursive in the re-scaled energies; window sum / (2k+1), zero-padded
            window = F.avg_pool1d(state["energies"], 2 * self.window + 1, stride=1, padding=self.window,
                                  count_include_pad=True)
            rescaled = self.continuity_lambda * energy + (1 - self.continuity_lambda) * window
            if valid is not None:
                rescaled = rescaled * valid  # padded positions never enter a window sum
            return rescaled, {"energies": rescaled}, None
        if variant == "coverage":  # Eq. 10, then Eq. 11
            weights = torch.softmax(torch.add(energy, state["accumulated"], alpha=-self.coverage_lambda * scale), -1)
            return weights, {"accumulated": state["accumulated"] + weights}, None
        if variant == "concat_weight":  # Eq. 3: + alpha_{i-1,j} (k_j . w) / sqrt(d_k)
            weights = torch.softmax(torch.addcmul(energy, state["weights"], keys_extra), -1)
            return weights, {"weights": weights}, None
        if variant == "concat_accumulated":  # Eq. 4: + (sum_{i'<i} alpha_{i',j}) (k_j . w) / sqrt(d_k)
            weights = torch.softmax(torch.addcmul(energy, state["accumulated"], keys_extra), -1)
            return weights, {"accumulated": state["accumulated"] + weights}, None
        if variant == "concat_context":  # Eq. 2: + k_j . (W_c c_{i-1}) / sqrt(d_k), c_{i-1} = sum_j' w_j' v_j'
            extra = (keys_extra @ state["context_weights"].unsqueeze(-1)).squeeze(-1)  # keys_extra = k W_c V^T / sqrt(d_k)
            weights = F.dropout(torch.softmax(energy + extra, -1), self.dropout, self.training)
            return weights, {"context_weights": weights}, None  # c_i^{l,n} = weights @ V, formed after the loop
        if variant == "expand_4":  # Eq. 8: g_k = W_gk^n c_{i-1}^{l,n}, g_v = c_{i-1}^{l,n} = sum_j w_j v_j
            previous = state["context_weights"]
            extra = (query * previous).sum(-1, keepdim=True)  # q_i . g_k / sqrt(d_k); query = q W_gk V^T / sqrt(d_k)
            weights = F.dropout(torch.softmax(torch.cat([energy, extra], -1), -1), self.dropout, self.training)
            combined = weights[..., :-1] + weights[..., -1:] * previous  # c_i = sum_j alpha_ij v_j + alpha_i,J+1 g_v
            return combined, {"context_weights": combined}, weights
        # expand key-value list (Eq. 5-7): one more (key, value) pair after the J source positions
        g_k, g_v = self.previous_pair(state["context"])
        extra = (query * g_k).sum(-1, keepdim=True) * scale
        weights = F.dropout(torch.softmax(torch.cat([energy, extra], -1), -1), self.dropout, self.training)
        context = (weights[..., None, :-1] @ values).squeeze(-2) + weights[..., -1:] * g_v
        if variant in ("expand_1", "expand_2"):  # the full context c_i^l (heads concatenated + output projection)
            context = self.out_proj(context.reshape(context.shape[0], self.d_model))
        return context, {"context": context}, weights

    def check_bounded(self, context, q, k, v):
        """The guard of the unnormalised recursion of Eq. 5-7: c_i is a linear function of c_{i-1} (through W_v and the
        output projection), so with large weights it grows geometrically across target positions (on a tiny model:
        1e16 within 12 steps at weight std 1, overflow in fp32 at std 3), and long before it overflows, cached
        decoding and the parallel forward part by float rounding. Raises FloatingPointError naming the variant and the
        fixes when the last carried context is non-finite or exceeds the largest source value it is mixed with by more
        than 1 / eps of its dtype (8e6 in fp32: the source then no longer counts at that precision). Costs one
        reduction over the [B, d] context per forward; the values are read only when it exceeds 1e3. Non-finite
        queries, keys or values (a cause upstream) are left to the model's check of its logits."""
        top = context.detach().abs().amax()
        if bool(top <= 1e3):  # the usual case
            return
        scale = v.detach().abs().amax()
        if bool(top <= scale / torch.finfo(context.dtype).eps) or not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
            return
        fix = ("set `recurrent_context_norm=True` (layer-normalises the carried context; a departure from the paper's "
               "equation, so the model must be trained with it)" if not self.context_norm else
               "(the context is already normalised: the weights themselves have diverged)")
        raise FloatingPointError(
            f"recurrent cross-attention (recurrent_variant={self.variant!r}, decoder layer {self.layer_idx}): the "
            f"previous context carried from step to step reached max |c| = {float(top):.3g} against max |v| = "
            f"{float(scale):.3g} for the source values ({context.dtype}). Eq. {5 + CONTEXT_VARIANTS.index(self.variant)} "
            f"feeds c_(i-1) back unnormalised and it grows geometrically when the weights are large (a diverging "
            f"training run, a learning rate too high, fp16), so the outputs are meaningless or about to overflow. "
            f"Fixes: lower the learning rate or keep gradient clipping, train in fp32 or bf16 rather than fp16, or {fix}.")

    def real_steps(self, decoder_padding, cache, length, device):
        """bool [B, T]: which of the call's T positions come at or after the row's first real token (``decoder_padding``
        [B]: the padding before it; positions from the cache's count), or None (no row starts with padding)."""
        if decoder_padding is None:
            return None
        start = cache.get_seq_length() if cache is not None else 0  # (a static cache's: its position tensor)
        positions = start + torch.arange(length, device=device)
        return positions[None, :] >= decoder_padding.to(device)[:, None]

    def forward(self, hidden, memory=None, mask=None, causal=False, cache=None, output_attentions=False,
                decoder_padding=None):
        """[B, T, d]; with ``output_attentions``, ``(output, weights)``: the weights each position attended with,
        after the variant's re-scaling (continuity, coverage) or query change (Eq. 2-4) and attention dropout,
        [B, H, T, J] over the source; for the expand variants (Eq. 5-8) [B, H, T, J + 1] over the expanded key-value
        list, whose last column is the weight of the extra pair (g_k, g_v) built from the previous step's context.
        ``decoder_padding`` [B] (or None): each row's padding before its first real decoder token, whose steps keep
        the state (module docstring)."""
        q, k, v = self.project(hidden, memory, cache)  # [B, H, T, d_k], [B, H, J, d_k]
        batch, _, length, _ = q.shape
        source_length = k.shape[-2]
        scale = self.head_dim**-0.5
        energies = (q @ k.transpose(-1, -2)) * scale  # hat-alpha for every target position at once [B, H, T, J]
        valid = None
        if mask is not None:
            if mask.dim() != 4 or mask.shape[-2] != 1:
                raise ValueError(f"`mask` of recurrent cross-attention must be a key padding mask [B, 1, 1, J], got "
                                 f"shape {tuple(mask.shape)}.")
            mask = mask[:, :, 0, :].expand(batch, 1, source_length)  # [B, 1, J]
            valid = mask.to(q.dtype)
            if self.variant != "continuity":
                energies = energies.masked_fill(~mask.unsqueeze(2), float("-inf"))
        keys_extra, queries = None, q
        if self.variant == "concat_context":  # Eq. 2 energy term as a [J, J] operator on the previous weights
            keys_extra = torch.einsum("bhjd,hde->bhje", k, self.context_query) @ v.transpose(-1, -2) * scale
        elif self.variant == "expand_4":  # Eq. 8 energy term q_i W_gk V^T / sqrt(d_k) on the previous weights
            queries = torch.einsum("bhtd,hde->bhte", q, self.g_key) @ v.transpose(-1, -2) * scale
        elif self.variant in ("concat_weight", "concat_accumulated"):
            keys_extra = torch.einsum("bhjd,hd->bhj", k, self.weight_query) * scale

        state = self.load_state(cache, batch, source_length, q)
        real = self.real_steps(decoder_padding, cache, length, q.device)
        outputs, step_weights = [], []
        per_position = [] if cache is not None and length > 1 else None  # (what a crop inside this call restores)
        for t, (energy, query) in enumerate(zip(energies.unbind(2), queries.unbind(2))):  # only this loop is sequential
            out, new_state, weights = self.step(energy, query, keys_extra, v, valid, state)
            if real is not None:  # padding before the row's first token: the state stays (its first reads zeros)
                new_state = {name: torch.where(real[:, t].view(-1, *[1] * (value.dim() - 1)), value, state[name])
                             for name, value in new_state.items()}
            state = new_state
            outputs.append(out)
            step_weights.append(weights)
            if per_position is not None:
                per_position.append(state)
        self.store_state(cache, state, per_position)
        if "context" in state and not is_tracing():
            self.check_bounded(state["context"], q, k, v)

        out = torch.stack(outputs, 1 if self.variant in ("expand_1", "expand_2") else 2)
        if self.variant.startswith("expand"):
            if self.variant == "expand_3":
                out = self.merge(out)  # [B, H, T, d_k] contexts
            elif self.variant == "expand_4":
                out = self.merge(out @ v)  # weights of the values (dropout applied)
            # (expand_1/2: [B, T, d], already the output projection of the heads)
            return (out, torch.stack(step_weights, 2)) if output_attentions else out
        if self.variant == "continuity":  # Eq. 11 for all positions at once
            if mask is not None:
                out = out.masked_fill(~mask.unsqueeze(2), float("-inf"))
            out = torch.softmax(out, -1)
        if self.variant != "concat_context":  # (its step applied the dropout)
            out = F.dropout(out, self.dropout, self.training)
        result = self.merge(out @ v)  # c_i = sum_j alpha_ij v_j for every position at once
        return (result, out) if output_attentions else result


class RecurrentConfig(HardAttnConfig):
    r"""Transformer whose cross-attention is recurrent (Rosendahl et al.), one variant per model.

    Args:
        recurrent_variant: one of ``RECURRENT_VARIANTS``: "concat_context" (Eq. 2), "concat_weight" (Eq. 3),
            "concat_accumulated" (Eq. 4), "expand_1" ... "expand_4" (Eq. 5-8), "continuity" (Eq. 9), "coverage"
            (Eq. 10). Default "expand_1", the variant the paper selects for its main comparison.
        continuity_window: window size k of Eq. 9 (integer >= 0; paper: 5).
        continuity_lambda: lambda of Eq. 9, in (0, 1] (paper: 0.5).
        coverage_lambda: lambda of Eq. 10, finite and >= 0 (paper: 0.5).
        recurrent_context_norm: False (the paper, default) or True: ``expand_1``-``expand_3`` build the extra
            pair from LN(c_{i-1}), a parameter-free layer norm of the previous context, instead of c_{i-1} itself
            (Eq. 5-7 use it as is). Eq. 5-7 are a linear recursion through c_{i-1} that large weights make grow
            geometrically over target positions (to inf, or to values where cached decoding and the parallel forward
            part by float rounding); normalised, the context stays bounded. Either way a non-finite context raises a
            FloatingPointError naming the variant.
        cross_attention: "recurrent" in every layer by default; a per-layer list (e.g. ["soft", "recurrent", ...])
            selects the layers that use it.
    """

    model_type = "recurrent_transformer"
    cross_attention: str | list[str] = "recurrent"
    recurrent_variant: str = DEFAULTS["recurrent_variant"]
    continuity_window: int = DEFAULTS["continuity_window"]
    continuity_lambda: float | int = DEFAULTS["continuity_lambda"]
    coverage_lambda: float | int = DEFAULTS["coverage_lambda"]
    recurrent_context_norm: bool = DEFAULTS["recurrent_context_norm"]

    def check(self):
        super().check()
        check_recurrent_settings(self.recurrent_variant, self.continuity_window, self.continuity_lambda,
                                 self.coverage_lambda, self.recurrent_context_norm)


class RecurrentPreTrainedModel(HardAttnPreTrainedModel):
    config_class = RecurrentConfig

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RecurrentCrossAttention):
            module.reset_recurrent_parameters()


class RecurrentModel(RecurrentPreTrainedModel, HardAttnModel):
    """The bare encoder-decoder (``AutoModel``): last_hidden_state = the decoder's last hidden state."""


class RecurrentForConditionalGeneration(RecurrentPreTrainedModel, HardAttnForConditionalGeneration, GenerationMixin):
    config_class = RecurrentConfig
    model_class = RecurrentModel
    card_title = "Transformer with recurrent cross-attention"
    card_description = (
        "The encoder-decoder attention of each decoder layer depends explicitly on its own previous decoding step, "
        "per head: the query is concatenated with the previous context (Eq. 2), the previous attention weight (Eq. 3) "
        "or the accumulated previous weights (Eq. 4); or the key-value list is expanded by one pair built from the "
        "previous context (Eq. 5-8, variants 1-4); or the energies are re-scaled for continuity (Eq. 9) or coverage "
        "(Eq. 10). `config.recurrent_variant` selects one. Training computes self-attention, FFN, projections and "
        "q K^T for all target positions in parallel and loops over positions only for the recurrent part of the "
        "attention step; decoding keeps the recurrent state in the cache (reordered by beam search)."
    )
    card_citation = (
        "Jan Rosendahl, Christian Herold, Frithjof Petrick, Hermann Ney. Recurrent Attention for the Transformer."
    )


__all__ = [
    "RECURRENT_VARIANTS",
    "RecurrentCrossAttention",
    "RecurrentConfig",
    "RecurrentForConditionalGeneration",
    "RecurrentModel",
    "check_recurrent_settings",
]
