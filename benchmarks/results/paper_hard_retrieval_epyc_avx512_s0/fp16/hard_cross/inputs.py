"""Clear errors where inputs enter the skeleton (token ids, padding masks, labels, the logits at inference), and the
teacher-forcing shift of labels into decoder inputs.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import math

import torch
from transformers.utils import is_tracing as hf_is_tracing


def is_tracing() -> bool:
    """Whether a graph is being traced (torch.compile / dynamo, torch.export, torch.jit.trace, CUDA graph capture),
    where a branch on a tensor's value (``bool(tensor...)``) cannot be taken: callers then take their general path
    (e.g. an explicit padding mask even when nothing is padded), which gives the same outputs."""
    return hf_is_tracing()


def check_ids(name: str, ids: torch.Tensor, vocab_size: int):
    """Token ids [batch, length]: integers in [0, vocab_size), at least one sentence of at least one token."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"`{name}` must be an integer tensor [batch, length], got {ids.dtype} of shape "
                         f"{tuple(ids.shape)}.")
    if 0 in ids.shape:
        raise ValueError(f"`{name}` is empty (shape {tuple(ids.shape)}); allowed: at least one sentence of at least "
                         f"one token.")
    if is_tracing():
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"`{name}` holds {ids[bad][0].item()}, outside the vocabulary; allowed: ids in [0, {vocab_size}).")


def check_mask(name: str, mask: torch.Tensor, shapes: list, right_padded: bool = False, values: bool = True,
               edges_only: bool = False, reason: str = ""):
    """A 0/1 padding mask whose shape is one of ``shapes``, with a token in every row (and, ``right_padded``, its
    padding after its tokens, ``reason`` saying why; ``edges_only``, its padding before its first token or after its
    last, none between two tokens); ``values=False`` checks the shape only."""
    if tuple(mask.shape) not in [tuple(shape) for shape in shapes]:
        allowed = " or ".join(str(tuple(shape)) for shape in shapes)
        raise ValueError(f"`{name}` has shape {tuple(mask.shape)}; allowed: {allowed} (one 0/1 entry per token).")
    if is_tracing() or not values:
        return
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(f"`{name}` must hold 0 (padding) and 1 (token) only, got {mask[bad][0].item()}.")
    present = mask.bool()
    empty = ~present.any(-1)
    if bool(empty.any()):
        raise ValueError(f"`{name}` row {int(empty.nonzero()[0])} is all padding; allowed: at least one token (1) per "
                         f"row.")
    left = present[:, 1:] & ~present[:, :-1]  # a token after padding
    hole = left & (present.cumsum(-1)[:, :-1] > 0)  # ... after a token
    if edges_only and bool(hole.any()):
        row = int(hole.nonzero()[0, 0])
        raise ValueError(f"`{name}` row {row} has padding between two tokens: {mask[row].tolist()}; "
                         f"allowed: padding before a row's first token (left) or after its last (right), none between "
                         f"two tokens.")
    if right_padded and bool(left.any()):
        row = int(left.nonzero()[0, 0])
        raise ValueError(f"`{name}` row {row} has padding before a token: {mask[row].tolist()}; decoder inputs must be "
                         f"padded on the right{reason}.")


def check_one_of(first: str, a, second: str, b, allow_neither: bool = False):
    if a is not None and b is not None:
        raise ValueError(f"Pass `{first}` or `{second}`, not both.")
    if a is None and b is None and not allow_neither:
        raise ValueError(f"Pass `{first}` or `{second}` (or `labels`, from which the decoder inputs are made).")


def check_labels(labels: torch.Tensor, vocab_size: int):
    """``labels`` [B, T]: integers, each -100 (ignored) or in [0, vocab_size), padded on the right. A row that starts
    with -100 and has real labels after it is left-padded (DataCollatorForSeq2Seq pads the labels on the tokenizer's
    ``padding_side``): its decoder input would be [start, pad, ..., y_1, ...], so it is refused, not learned from."""
    if labels.dim() != 2 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must be an integer tensor [batch, target length], got {labels.dtype} of shape "
                         f"{tuple(labels.shape)}.")
    if is_tracing():  # (the loss checks its labels inside the graph)
        return
    bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"`labels` must be -100 (ignored) or in [0, {vocab_size}), got {labels[bad][0].item()}.")
    left = (labels[:, 0] == -100) & (labels != -100).any(-1)
    if bool(left.any()):
        row = int(left.nonzero()[0])
        raise ValueError(f"`labels` row {row} starts with -100 (ignored) before its tokens: {labels[row].tolist()}; "
                         f"labels must be padded on the right (the collator pads them on the tokenizer's side: set "
                         f"tokenizer.padding_side='right').")


def check_labels_match(labels: torch.Tensor, decoder_input_ids, decoder_inputs_embeds):
    """``labels`` given with decoder inputs: one label per decoder position, [batch, target length] of both."""
    given, name = ((decoder_input_ids, "decoder_input_ids") if decoder_input_ids is not None
                   else (decoder_inputs_embeds, "decoder_inputs_embeds"))
    if given is None or given.dim() < 2 or tuple(given.shape[:2]) == tuple(labels.shape):
        return
    raise ValueError(f"`labels` has shape {tuple(labels.shape)} but `{name}` {tuple(given.shape[:2])} [batch, target "
                     f"length]; allowed: labels of the decoder inputs' [batch, target length] (one label per decoder "
                     f"position), or `labels` alone (the decoder inputs are then made from them).")


def check_generation_config(generation_config, model) -> None:
    """``generate()``'s settings that transformers lets through to a deep failure, refused where generate() is called:
    ``num_beams`` below 1 (a ZeroDivisionError inside beam search) and the offloaded caches, which move the cache
    to the CPU between steps on CUDA streams: on a CPU model an AssertionError about CUDA at the first decoding step,
    on a CUDA one a device mismatch in the attention kinds, which read the cache where it lies. (``"static"``: see
    ``HardAttnForConditionalGeneration._prepare_cache_for_generation``.)"""
    beams = generation_config.num_beams
    if beams is not None and (isinstance(beams, bool) or not isinstance(beams, int) or beams < 1):
        raise ValueError(f"`num_beams`={beams!r} is not a number of beams; allowed: an integer >= 1 (1: greedy decoding "
                         f"or sampling, more: beam search).")
    cache = generation_config.cache_implementation
    if isinstance(cache, str) and cache.startswith("offloaded"):
        raise ValueError(f"`cache_implementation`={cache!r} is not supported by {type(model).__name__} (on "
                         f"{model.device}): it moves the cache to the CPU between steps on CUDA streams, which these "
                         f"models' attention kinds do not read back; allowed `cache_implementation`: None or "
                         f"'dynamic' (or 'static' for the model types that support it).")


def check_generated_length(generation_config, limit) -> None:
    """The decoder positions ``generate()`` will need (``max_length`` - 1: the last token is not fed back), against
    ``limit``, the decoder's learned position table (``max_position_embeddings``; None: no limit): refused when
    generate() is called, not at the step that runs past the table."""
    if limit is None or generation_config.max_length is None:
        return
    needed = generation_config.max_length - 1
    if needed <= limit:
        return
    new = generation_config.max_new_tokens
    asked = f"`max_new_tokens`={new}" if new is not None else f"`max_length`={generation_config.max_length}"
    longest = limit + 1 - (generation_config.max_length - new) if new is not None else limit + 1
    raise ValueError(f"{asked} needs {needed} decoder positions, beyond `max_position_embeddings`={limit} with "
                     f"`position_embedding`='learned'; allowed: {asked.split('=')[0]} at most {longest} here "
                     f"(or a model with position_embedding='sinusoidal', which extends beyond the table).")


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder inputs: [start, y_1, ..., y_{n-1}], with -100 label padding replaced by pad."""
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill_(shifted == -100, pad_token_id)


def check_finite_logits(logits: torch.Tensor, model) -> None:
    """FloatingPointError if inference ``logits`` hold NaN or +inf (-inf is a legitimate log-probability): generate()
    would otherwise go on emitting tokens chosen from NaN scores (greedy and beam search pick pad with a NaN score,
    sampling stops in torch.multinomial). One reduction over the logits (amax propagates NaN) and one sync per
    forward, a cost far below the output projection's."""
    if not bool(logits.detach().amax() < math.inf):
        raise FloatingPointError(
            f"{type(model).__name__} ({model.config.model_type}) computed NaN or +inf scores at inference: its weights "
            f"or activations have overflowed, so no token it would emit means anything. Check the weights for NaN/inf "
            f"(a diverged training run: lower the learning rate, keep gradient clipping, train in fp32 or bf16 rather "
            f"than fp16) and the inputs (`inputs_embeds`).")


__all__ = ["check_finite_logits", "check_generated_length", "check_generation_config", "check_ids", "check_labels",
           "check_labels_match", "check_mask", "check_one_of", "is_tracing", "shift_tokens_right"]
