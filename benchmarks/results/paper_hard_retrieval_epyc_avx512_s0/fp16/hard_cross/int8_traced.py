"""int8 linear layers written in torch operators, which ``torch.compile`` traces and inductor compiles:
``quantize_int8(engine="traced")``.

torch's dynamic int8 linears (``quantize_int8``'s "fbgemm" / "onednn" engines) hold their weights packed in an opaque
object that dynamo cannot trace; a compiled step calls their kernel through an operator that it leaves closed
(``packed_linear.INT8_LINEAR_OP``). Here the quantisation is written in plain torch operators around
``torch._int_mm`` (int8 x int8 -> int32) instead: the int8 weight is an ordinary buffer, the activation is quantised
at every call by the operators below, and inductor fuses the quantisation into one kernel before the product and the
rescale (and the bias) into one after it.

The arithmetic, for an input row x (d_in values) and output channel j (weight row w_j):

* weights, symmetric per output channel: s_w_j = max_k |w_jk| / 127, q_w_jk = round(w_jk / s_w_j) in [-127, 127];
* activations, symmetric per row of the call: s_x = max_k |x_k| / 127, q_x_k = round(x_k / s_x) in [-127, 127]
  (a row of zeros: s_x = ``ZERO_ROW_SCALE``, all q_x 0);
* y_j = (sum_k q_x_k q_w_jk) * s_x * s_w_j + b_j, the sum exact in int32, the rest in float32.

Unlike the fbgemm engine's one activation scale per call (the whole [rows, d_in] input), each row has its own, so an
output row does not depend on the other sentences of the batch or on whether earlier positions are cached; the
rounding error per element is at most s_x / 2 (8 bits signed around zero; fbgemm: 7 bits unsigned over [min, max]).

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import torch
from torch import nn

Q_MAX = 127  # symmetric int8 range [-127, 127] for weights and activations (-128 unused: no zero point needed)
ZERO_ROW_SCALE = 1.0  # the scale of an all-zero row or weight row (its integers are all 0 whatever the scale)


def symmetric_scale(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """max |values| / Q_MAX along ``dim`` (kept), ``ZERO_ROW_SCALE`` where that is 0."""
    scale = values.abs().amax(dim, keepdim=True) / Q_MAX
    return torch.where(scale == 0, ZERO_ROW_SCALE, scale)


def quantize_symmetric(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(values / scale) clipped to [-Q_MAX, Q_MAX], as int8 (ties to even, torch.round's rule)."""
    return torch.round(values / scale).clamp(-Q_MAX, Q_MAX).to(torch.int8)


class TracedInt8Linear(nn.Module):
    """A linear layer with int8 weights (buffers ``weight_int8`` [out, in], ``weight_scale`` [out], ``bias`` [out] or
    None) whose call quantises its input per row and multiplies with ``torch._int_mm`` (see the module docstring for
    the arithmetic). No parameters: it is for inference only."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = symmetric_scale(weight)  # [out, 1]
        self.register_buffer("weight_int8", quantize_symmetric(weight, scale).contiguous())
        # the same codes [in, out]: torch._int_mm's CPU kernel takes a single row fastest against [out, in] (transposed
        # view) and several rows against [in, out] (see benchmarks/README.md, section "Decoding speed")
        self.register_buffer("weight_int8_by_column", self.weight_int8.t().contiguous())
        self.register_buffer("weight_scale", scale[:, 0].contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scale = symmetric_scale(rows)  # [rows, 1]
        weight = self.weight_int8.t() if rows.shape[0] == 1 else self.weight_int8_by_column  # [in, out] either way
        products = torch._int_mm(quantize_symmetric(rows, scale), weight)  # int32, exact
        out = products.to(torch.float32) * scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` gives the exact int32 products here, checked on the largest ones the layers make
    (codes of +-127 summed over 64 terms, one row against [out, in] transposed and 4 rows against [in, out], the two
    layouts the layers use). Its CPU kernel is oneDNN's: without VNNI (an AVX2-only CPU, or oneDNN capped by
    ``ONEDNN_MAX_CPU_ISA``) s8 x s8 products go through 16-bit pair sums that saturate, and the products are wrong."""
    if not hasattr(_int_mm_is_exact, "value"):
        codes = torch.tensor([Q_MAX, -Q_MAX], dtype=torch.int8).repeat(32)  # 64 alternating extremes
        same = torch.full((64,), Q_MAX, dtype=torch.int8)  # 64 equal extremes (the largest pair sums)
        weight = torch.stack([same, -same, codes, -codes] * 2)  # [8 out, 64 in]
        exact = True
        for rows in (same[None], torch.stack([same, -same, codes, -codes])):
            layout = weight.t() if rows.shape[0] == 1 else weight.t().contiguous()
            expected = rows.long() @ weight.t().long()
            exact = exact and torch.equal(torch._int_mm(rows, layout).long(), expected)
        _int_mm_is_exact.value = exact
    return _int_mm_is_exact.value


def _int_mm_is_exact():
    """(holds the answer of :func:`int_mm_is_exact` for the process)"""


def check_int_mm():
    """A clear error where ``torch._int_mm`` is not exact (:func:`int_mm_is_exact`)."""
    if not int_mm_is_exact():
        raise ValueError("quantize_int8(): `engine`='traced' needs exact int8 products from torch._int_mm, which this "
                         "CPU / oneDNN build does not give (its s8 x s8 kernel saturates without VNNI, or oneDNN is "
                         "capped by ONEDNN_MAX_CPU_ISA); allowed here: engine='fbgemm' or 'onednn' (they compile too).")


def traced_int8_linears(model: nn.Module, names: list) -> nn.Module:
    """The ``nn.Linear`` layers ``names`` of ``model`` (in place) as :class:`TracedInt8Linear`. Returns ``model``.
    Refused where ``torch._int_mm`` is not exact (:func:`int_mm_is_exact`)."""
    check_int_mm()
    for name in names:
        model.set_submodule(name, TracedInt8Linear(model.get_submodule(name)))
    return model


__all__ = ["TracedInt8Linear", "traced_int8_linears", "symmetric_scale", "quantize_symmetric"]
