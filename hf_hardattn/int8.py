"""int8 inference on CPU: :meth:`Int8Mixin.quantize_int8` turns a model's linear layers into torch's dynamic
int8 linears; the model then refuses what int8 layers cannot do (training, saving, other dtypes or devices).

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import warnings

import torch
from torch import nn

from .int8_traced import check_int_mm, traced_int8_linears
from .packed_linear import Int8Linear, unpack_linears


class Int8Mixin:
    """The int8 path of ``HardAttnPreTrainedModel`` (mixed in before transformers' ``PreTrainedModel``)."""

    # linear layers whose weight the model's fast path reads directly (not through the layer's call; a layer that is
    # not a plain nn.Linear is called instead): kept in fp32 by quantize_int8 (name suffixes; variants extend it)
    INT8_KEEP: tuple = ()
    is_int8: bool = False  # set by quantize_int8

    def quantize_int8(self, engine: str = "fbgemm"):
        """int8 inference on CPU: every linear layer (the vocabulary projection and the hybrid's GRU/LSTM gate
        projections included) becomes an int8 linear layer for ``engine``. "fbgemm" (default; the faster of the two
        packed engines on the CPUs measured, see benchmarks/README.md, section "Decoding speed") or "onednn" (the same
        quantisation, other kernels: VNNI / AMX where the CPU has them): torch's dynamic int8 linear
        (``torch.ao.quantization.quantize_dynamic``), its weights packed for that engine whatever
        ``torch.backends.quantized.engine`` says (a compiled decoding step calls their kernel through an operator,
        see ``packed_linear.Int8Linear``). ``TRACED_ENGINE`` ("traced"): int8 layers written in torch operators, which
        inductor compiles into the step (:mod:`int8_traced`: one activation scale per row, ``torch._int_mm``). The
        packed engines' arithmetic: int8 weights with one scale per output channel (symmetric, w ~ s_j * round(w / s_j), s_j = max|w_j| / 127.5), activations quantised at every call to
        7-bit unsigned integers with one scale and zero point for the whole input tensor (its min and max), int32
        accumulation, fp32 output. Because the activation scale is shared by the rows of a call, an int8 output
        depends slightly on the other sentences of the batch and on whether earlier positions are cached (the fp32
        model's do not). Layers whose weight the model reads directly stay fp32 (``INT8_KEEP``: beam-joint's
        vocabulary mixture and candidate readout, the additive attention's score vector); attention kernels,
        embeddings, norms and the gate arithmetic stay fp32. Packed linears are unpacked first (int8 replaces them).
        Inference only: afterwards ``train()`` and ``save_pretrained`` raise; reload the fp32 checkpoint to undo.
        Returns the model."""
        engines = [name for name in INT8_ENGINES if name in torch.backends.quantized.supported_engines]
        if engine not in engines and engine != TRACED_ENGINE:
            raise ValueError(f"quantize_int8(): `engine`={engine!r} is not an int8 engine of this torch build; allowed: "
                             f"{engines} (torch's packed int8 layers) or {TRACED_ENGINE!r} (int8 layers in torch "
                             f"operators).")
        if engine == TRACED_ENGINE:
            check_int_mm()  # (before any change to the model)
        if self.training:
            raise ValueError("quantize_int8() is for inference: call model.eval() first (int8 layers have no gradient).")
        if self.is_int8:
            raise ValueError("quantize_int8(): the model is already int8; reload the fp32 checkpoint to start again.")
        kinds = {(p.dtype, p.device.type) for p in self.parameters()}
        if kinds != {(torch.float32, "cpu")}:
            raise ValueError(f"quantize_int8() needs an fp32 model on the CPU (torch's int8 layers run there only); "
                             f"its parameters are {sorted(f'{d} on {t}' for d, t in kinds)}: load or keep it in "
                             f"float32 (bfloat16 and int8 are two separate choices).")
        adapters = [name for name, module in self.named_modules() if type(module).__module__.startswith("peft.")]
        if adapters:  # their own small linears would become int8 layers, which the adapter code cannot read
            raise ValueError(f"quantize_int8(): the model carries PEFT adapter layers ({len(adapters)}, e.g. "
                             f"{adapters[0]!r}); merge them into the weights first (`model = "
                             f"peft_model.merge_and_unload()`), then quantize the merged model.")
        unpack_linears(self)
        keep = self.INT8_KEEP or ("\0",)
        names = [name for name, module in self.named_modules()
                 if isinstance(module, nn.Linear) and not name.endswith(keep)]
        for name in names:  # a subclass of nn.Linear (the hybrid's RNNHiddenProjection) is called as a plain layer:
            module = self.get_submodule(name)  # torch quantizes nn.Linear itself only
            if type(module) is not nn.Linear:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
                plain.weight, plain.bias = module.weight, module.bias
                self.set_submodule(name, plain)
        if engine == TRACED_ENGINE:
            traced_int8_linears(self, names)
        else:
            int8_linears(self, names, engine)
        self.is_int8 = True
        return self

    def _apply(self, fn, *args, **kwargs):
        """``to`` / ``half`` / ``bfloat16`` / ``cuda``: refused on an int8 model for any other dtype than float32 or a
        device other than the CPU (its int8 layers would fail deep inside the first call)."""
        if self.is_int8:
            probe = fn(torch.zeros((), dtype=torch.float32))
            if probe.dtype != torch.float32 or probe.device.type != "cpu":
                raise ValueError(f"this model was quantized with quantize_int8(): its int8 layers take float32 inputs on "
                                 f"the CPU, so it cannot move to {probe.dtype} on {probe.device.type}; reload the fp32 "
                                 f"checkpoint for that (int8 and bfloat16 are two separate choices).")
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode: bool = True):
        if mode and self.is_int8:
            raise ValueError("this model was quantized with quantize_int8() for inference; reload the fp32 checkpoint "
                             "to train it.")
        return super().train(mode)


INT8_ENGINES = ("fbgemm", "onednn")  # torch's quantized engines that quantize_int8 packs for (x86)
TRACED_ENGINE = "traced"  # quantize_int8's int8 layers in torch operators (int8_traced.py)


def int8_linears(model: nn.Module, names: list, engine: str) -> nn.Module:
    """The ``nn.Linear`` layers ``names`` of ``model`` (in place) as torch's dynamic int8 linears packed for ``engine``
    (one of ``INT8_ENGINES``, named explicitly: not the "x86" engine's per-CPU choice), each as an
    :class:`~packed_linear.Int8Linear` (the same kernel on a shorter call path). Returns ``model``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice (still shipped in 2.13)
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        previous = torch.backends.quantized.engine  # the packed weights keep the engine they were packed with
        torch.backends.quantized.engine = engine
        try:
            quantize_dynamic(model, dict.fromkeys(names, per_channel_dynamic_qconfig), dtype=torch.qint8, inplace=True)
        finally:
            torch.backends.quantized.engine = previous
    for name in names:
        Int8Linear.swap_into(model.get_submodule(name))
    return model


__all__ = ["Int8Mixin"]
