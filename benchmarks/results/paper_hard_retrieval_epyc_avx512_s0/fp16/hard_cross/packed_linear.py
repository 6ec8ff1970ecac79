"""Faster CPU decoding: ``nn.Linear`` layers that multiply small inputs with a oneDNN-prepacked copy of their weight.

Decoding multiplies each weight matrix by a few rows per step (batch x beams). On some CPUs MKL's fp32 GEMM, which
``F.linear`` uses, is slow for such inputs, and a few rows can cost several times one row. oneDNN's kernel on a
weight reordered once for it (what inductor uses for frozen CPU graphs) is faster there for a few rows, about even
near a hundred rows and slower for many. Hence the default ``max_rows`` of 128; ``benchmarks/linear_kernels.py``
times both kernels per row count, and benchmarks/README.md (section "Decoding speed") gives the end-to-end figures.

:func:`pack_linears` keeps every parameter as it is (state dict, saving, tied weights and training are unchanged).
Each linear layer gets a packed copy of its weight, used only when all of these hold:

* no gradient is needed (``generate`` runs under no_grad);
* the input is fp32 on CPU;
* it has at most ``max_rows`` rows.

Any other call runs ``F.linear``. The packed copy is rebuilt when the weight changes in place (optimizer steps,
``load_state_dict``), which is detected through its version counter, so it never goes stale.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import hashlib
import weakref
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MAX_ROWS = 128


def packing_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (x86 and most ARM builds)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedWeight:
    """The packed copy of one layer's weight, its bias (detached) and the key (weight storage, weight version, bias
    storage) they were taken at. The packed weight is an opaque oneDNN tensor that cannot be copied or pickled, so
    a copy of the model starts without it and packs again when used."""

    __slots__ = ("key", "weight", "bias")

    def __init__(self):
        self.key = self.weight = self.bias = None

    def __deepcopy__(self, memo):
        return PackedWeight()

    def __reduce__(self):
        return PackedWeight, ()


def _packed_forward(self, x):
    weight, bias = self.weight, self.bias
    if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():  # the packed weight is opaque to dynamo: the layer's path as a closed operator
        return PACKED_LINEAR_OP(x, self.packed_key, self.out_features)
    _register(self)
    return _packed_call(self, x)


def _packed_call(self, x):
    """The eager packed path of a layer set up by :func:`pack_linears` (``F.linear`` where packing does not apply)."""
    weight, bias = self.weight, self.bias
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not 0 < rows <= self.packed_max_rows or x.dtype != torch.float32 or not x.is_cpu:
        return F.linear(x, weight, bias)
    packed = self.packed_weight
    key = (weight.data_ptr(), weight._version, None if bias is None else bias.data_ptr())
    if packed.key != key:  # first call, or the weight changed (in place or replaced) since it was packed
        if weight.dtype != torch.float32 or not weight.is_cpu:
            return F.linear(x, weight, bias)
        with torch.no_grad():
            packed.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        packed.bias = None if bias is None else bias.detach()  # shares storage: in-place changes reach it
        packed.key = key
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")  # any [..., in] input


def pack_linears(module: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> nn.Module:
    """Give every ``nn.Linear`` in ``module`` (any model, e.g. a MarianMTModel too) the prepacked path for inputs of
    at most ``max_rows`` rows; returns ``module``. :func:`unpack_linears` undoes it."""
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"`max_rows` must be a positive integer, got {max_rows!r}.")
    if not packing_available():
        raise RuntimeError("pack_linears needs oneDNN's prepacked linear (torch.ops.mkldnn._reorder_linear_weight / "
                           "_linear_pointwise), which this torch build does not have.")
    for linear in module.modules():
        if isinstance(linear, nn.Linear):
            linear.packed_max_rows = max_rows
            linear.packed_weight = PackedWeight()
            linear.forward = MethodType(_packed_forward, linear)
            linear.register_buffer("packed_key", torch.zeros(1), persistent=False)  # (see PACKED_LINEAR_OP)
            _register(linear)
    return module


def packed_layers(module: nn.Module) -> list:
    """The linear layers of ``module`` that :func:`pack_linears` set up."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and "packed_max_rows" in m.__dict__]


def unpack_linears(module: nn.Module) -> nn.Module:
    """Back to plain ``nn.Linear.forward`` everywhere in ``module`` (frees the packed copies); returns ``module``."""
    for linear in packed_layers(module):
        for name in ("forward", "packed_max_rows", "packed_weight", "packed_key"):
            delattr(linear, name)
    return module


def is_packed(module: nn.Module) -> bool:
    return bool(packed_layers(module))


__all__ = ["pack_linears", "unpack_linears", "is_packed", "packed_layers", "packing_available", "DEFAULT_MAX_ROWS"]


class Int8Linear(torch.ao.nn.quantized.dynamic.Linear):
    """torch's dynamic int8 linear layer (what ``quantize_int8()`` makes of each ``nn.Linear``) with the shortest
    call path: the same kernel with the same arguments as torch's module (``quantized::linear_dynamic`` on the
    packed int8 weight, ``reduce_range=True``), without the per-call checks of a layer that may hold fp16 weights
    or an old serialization version. Decoding calls dozens of linear layers per step, so at batch 1 those checks are
    a visible part of the step (see benchmarks/README.md, section "Decoding speed"; the outputs are bit for bit the
    same), and it calls the operator's C++ entry (``OpOverload._op``) directly, without the Python check for traced
    script objects that an operator taking packed weights runs at every call. Made by class swap in
    ``quantize_int8``, so state dict and repr are torch's.

    Under ``torch.compile`` (dynamo cannot trace the packed weights, an opaque script object) the layer calls the same
    kernel through :data:`INT8_LINEAR_OP`, an operator that dynamo and inductor leave closed: it takes the layer's key
    buffer ``packed_key`` (not saved) and finds the layer, registered under the buffer's address by every eager call
    and by ``swap_into`` (a copy of the model registers at its first eager call: generate()'s first step runs eagerly).
    So a compiled decoding step runs fbgemm's (or oneDNN's) int8 kernel with the same arguments as the eager layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = INT8_LINEAR_OP(x, self.packed_key, self.out_features)
        else:
            _register(self)
            out = _LINEAR_DYNAMIC(x, self._packed_params._packed_params, True)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @classmethod
    def swap_into(cls, module: nn.Module) -> nn.Module:
        """``module`` (a ``torch.ao.nn.quantized.dynamic.Linear`` with int8 weights) as an :class:`Int8Linear`."""
        if type(module) is not torch.ao.nn.quantized.dynamic.Linear or module._packed_params.dtype != torch.qint8:
            raise TypeError(f"Int8Linear.swap_into takes torch's dynamic int8 Linear, got {module!r}.")
        module.__class__ = cls
        module.register_buffer("packed_key", torch.zeros(1), persistent=False)
        _register(module)
        return module


_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default._op  # the C++ entry of the operator

# The int8 layers by the address of their key buffer (weak: a layer that is gone drops out), read by INT8_LINEAR_OP.
_LAYERS: dict = {}


def _register(layer: Int8Linear):
    address = layer.packed_key.data_ptr()
    entry = _LAYERS.get(address)
    if entry is None or entry() is not layer:
        _LAYERS[address] = weakref.ref(layer, lambda ref, address=address: _LAYERS.get(address) is ref and
                                       _LAYERS.pop(address))


def _registered(key: torch.Tensor, what: str):
    entry = _LAYERS.get(key.data_ptr())
    layer = None if entry is None else entry()
    if layer is None or layer.packed_key.data_ptr() != key.data_ptr():
        raise RuntimeError(f"{what} ran compiled before any eager call of it (a copy of a model registers its layers "
                           f"at its first eager call): call the model once without torch.compile first, as "
                           f"generate()'s first step does.")
    return layer


def _int8_linear(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    layer = _registered(key, "an int8 layer (quantize_int8)")
    return _LINEAR_DYNAMIC(x, layer._packed_params._packed_params, True)


def _packed_linear(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return _packed_call(_registered(key, "a packed linear layer (pack_linears)"), x)


def _define_layer_op(kind: str, name: str, impl):
    """An operator ``OP(x, key, out_features)``: the layer registered under ``key``'s address applied to ``x`` by
    ``impl`` (its fake, for tracing: the output's shape), which dynamo and inductor leave closed. One operator per copy
    of this module (a saved model's remote code is another copy), each in its own namespace, so a second import defines
    no name twice."""
    namespace = f"hf_hardattn_{kind}_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]
    if not hasattr(torch.ops, namespace) or not hasattr(getattr(torch.ops, namespace), name):
        library = torch.library.Library(namespace, "DEF")
        library.define(f"{name}(Tensor x, Tensor key, int out_features) -> Tensor")
        library.impl(name, impl, "CPU")
        torch.library.register_fake(f"{namespace}::{name}", lambda x, key, out_features: x.new_empty(
            (*x.shape[:-1], out_features)), lib=library)
        _LIBRARIES.append(library)  # the operator lives as long as its library
    return getattr(getattr(torch.ops, namespace), name).default


_LIBRARIES: list = []
INT8_LINEAR_OP = _define_layer_op("int8", "linear_dynamic", _int8_linear)  # an int8 layer's fbgemm / oneDNN kernel
PACKED_LINEAR_OP = _define_layer_op("packed", "linear", _packed_linear)  # a packed fp32 layer's oneDNN kernel
