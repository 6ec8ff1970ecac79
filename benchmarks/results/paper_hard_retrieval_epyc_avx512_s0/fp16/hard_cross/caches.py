"""The decoding caches of the skeleton: :class:`HardAttnCache` (transformers' ``EncoderDecoderCache`` plus the state a
decoder carries from step to step, reordered for beam search), the buffered self-attention cache it starts with, and
:class:`StaticHardAttnCache`, its preallocated, compileable form (``generate(..., cache_implementation="static")``).

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.modeling_outputs import Seq2SeqLMOutput

from .inputs import is_tracing

# transformers 5.24 renamed the decoding cache from `past_key_values` to `cache`: generate() passes `cache=` and model
# outputs carry `.cache`; earlier 5.x releases use `past_key_values` for both. forward() accepts either name, and
# outputs use the installed release's field (read a cache from an output as `getattr(output, CACHE_FIELD)`).
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"

# transformers changed the meaning of a cache's `crop(n)` within 5.x: it was the length to keep (n >= 0) or minus the
# positions to remove (n < 0), and is now only the latter (n <= 0; 5.24 passes `crop(0)` as "remove nothing"). The
# caches here follow the installed release, whose assisted decoding calls it (`assistant_model`, prompt lookup).
CROP_KEEPS_LENGTH = "tokens_to_remove" not in inspect.signature(DynamicLayer.crop).parameters


def cropped_length(length: int, n: int) -> int:
    """The length of a cache of ``length`` positions after ``crop(n)`` in the installed transformers' convention."""
    if n < 0:
        return max(0, length + n)
    if CROP_KEEPS_LENGTH:
        return min(length, n)
    if n > 0:
        raise ValueError(f"`crop` takes minus the number of positions to remove (<= 0), got {n}.")
    return length


class BufferedLayer(DynamicLayer):
    """A self-attention cache layer whose keys/values live in a preallocated, time-major buffer [T_max, B, H, D]
    that doubles when full. ``keys``/``values`` are [B, H, T, D] views of its filled part.

    ``DynamicLayer`` copies the whole cache at every step (``torch.cat``) and again at every beam reorder
    (``index_select``); here a step writes one time slot, and a reorder copies only the rows that take another row's
    past (in place, on the CPU when at most half do) or gathers the filled part into a second buffer in one pass
    (``index_select(out=...)``) and swaps the two. Other batch edits (repeat, select, crop) are rare and rebuild the
    buffer from the current keys/values. While autograd tracks the cache (a loss over step-by-step decoding), steps
    and reorders go out of place instead, as in ``DynamicLayer``: an in-place write would change keys that earlier
    steps saved for backward, and ``out=`` records no gradient."""

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length, self._k, self._v, self._spare = 0, None, None, None
        self.is_initialized = True

    def _tracked(self, *tensors) -> bool:
        """Whether autograd tracks the cache's buffers or the given new keys/values (then: no in-place writes)."""
        return any(t is not None and t.requires_grad for t in (self._k, self._v, *tensors))

    def _views(self):
        self.keys = self._k[: self.length].permute(1, 2, 0, 3)
        self.values = self._v[: self.length].permute(1, 2, 0, 3)

    def _reserve(self, key_states, value_states, needed):
        if self._k is not None and needed <= self._k.shape[0] and key_states.shape[0] == self._k.shape[1]:
            return
        capacity = max(needed, 32, 2 * (self._k.shape[0] if self._k is not None else 0))
        k = key_states.new_empty((capacity, *key_states.permute(2, 0, 1, 3).shape[1:]))
        v = value_states.new_empty((capacity, *value_states.permute(2, 0, 1, 3).shape[1:]))
        if self.length:
            k[: self.length] = self._k[: self.length]
            v[: self.length] = self._v[: self.length]
        self._k, self._v, self._spare = k, v, None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        steps = key_states.shape[-2]
        new_k, new_v = key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3)
        if self._tracked(key_states, value_states):
            if self.length:
                new_k, new_v = torch.cat([self._k[: self.length], new_k]), torch.cat([self._v[: self.length], new_v])
            self._k, self._v, self._spare = new_k, new_v, None
        else:
            self._reserve(key_states, value_states, self.length + steps)
            self._k[self.length : self.length + steps] = new_k
            self._v[self.length : self.length + steps] = new_v
        self.length += steps
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reorder_cache(self, beam_idx):
        if not self.get_seq_length():
            return
        beam_idx = beam_idx.to(self.device)
        keys, values = self._k[: self.length], self._v[: self.length]
        if self._tracked():
            self._k, self._v, self._spare = keys.index_select(1, beam_idx), values.index_select(1, beam_idx), None
        else:
            moved = None  # on the CPU (elsewhere the row count would cost a device sync per layer and step)
            if self.device.type == "cpu" and len(beam_idx) == keys.shape[1]:
                moved = (beam_idx != torch.arange(len(beam_idx), device=self.device)).nonzero().squeeze(1)
            if moved is not None and 2 * len(moved) <= len(beam_idx):  # few rows take another row's past (most
                for buffer in (keys, values):  # beams keep their own): just those, all read before any is written
                    buffer.index_copy_(1, moved, buffer.index_select(1, beam_idx[moved]))
            else:
                if self._spare is None:
                    self._spare = (torch.empty_like(self._k), torch.empty_like(self._v))
                spare_k, spare_v = self._spare
                torch.index_select(keys, 1, beam_idx, out=spare_k[: self.length])
                torch.index_select(values, 1, beam_idx, out=spare_v[: self.length])
                self._spare, self._k, self._v = (self._k, self._v), spare_k, spare_v
        self._views()

    def _rebuild(self, keys, values):
        self.length, self._k, self._v, self._spare = 0, None, None, None
        if keys.shape[-2]:
            self.update(keys, values)
        else:
            self.keys, self.values = keys, values

    def batch_repeat_interleave(self, repeats: int):
        if self.get_seq_length():
            self._rebuild(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        if self.get_seq_length():
            self._rebuild(self.keys[indices], self.values[indices])

    def crop(self, n: int):
        """Keep the first positions: see :func:`cropped_length` for ``n``."""
        length = cropped_length(self.get_seq_length(), n)
        if length < self.get_seq_length():
            self.length = length
            self._views()

    def reset(self):
        self.keys = self.values = None
        self.length, self._k, self._v, self._spare = 0, None, None, None
        self.is_initialized = False


class BufferedCache(DynamicCache):
    """A ``DynamicCache`` made of :class:`BufferedLayer` s (the decoder self-attention cache of hf_hardattn)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = BufferedLayer


class HardAttnCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` plus the state that a decoder carries from one step to the next.

    * self-attention keys/values are appended per step (``self_attention_cache``), cross-attention keys/values are
      computed once per sentence (``cross_attention_cache`` + ``is_updated``), exactly as in transformers;
    * ``states`` maps a name (e.g. ``"gru.0"`` or ``"prev_context.3"``) to a tensor whose first dimension is the
      batch; :meth:`reorder_cache` reorders them together with the keys/values, so beam search never mixes beams;
    * ``sentence_states``: the same for tensors that are constant over a sentence's decoding (computed from the
      encoder output once); like the cross-attention keys/values, beam reordering leaves them alone;
    * ``seen_tokens`` counts the target positions processed, so that decoders without a self-attention cache
      (an RNN decoder) still report the right ``get_seq_length()`` to ``generate()``;
    * for :meth:`crop`, the states after every position written (references to the tensors a step writes anyway,
      not copies; for a call of several positions, those its decoder hands :meth:`set_state` as ``per_position``);
      beam reorders after a kept state are applied to it only when a crop restores it.

    Beam search only ever reorders beams *within* a sentence, and every beam of a sentence has the same
    cross-attention keys/values, so :meth:`reorder_cache` leaves the cross-attention cache alone (it is the same
    tensor after reordering). Use :meth:`batch_select_indices` for an arbitrary selection. Under ``generate()`` with
    beams or several returned sequences the cross-attention cache may hold one row per sentence, not per beam
    (grouped memory, see :class:`SoftAttention`).
    """

    def __init__(self, self_attention_cache=None, cross_attention_cache=None):
        super().__init__(
            self_attention_cache if self_attention_cache is not None else BufferedCache(),
            cross_attention_cache if cross_attention_cache is not None else DynamicCache(),
        )
        self.states: dict[str, torch.Tensor] = {}
        self.sentence_states: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0
        self._forget_past()

    def _forget_past(self):
        # position p -> (the states after p positions, None for one not known there; how many reorders came before)
        self._past: dict[int, tuple[dict, int]] = {self.seen_tokens: (dict(self.states), 0)}
        self._reorders: list[torch.Tensor] = []  # beam_idx of every reorder_cache since
        self._per_position: dict[str, list] = {}  # the current call's set_state(..., per_position)

    @classmethod
    def from_cache(cls, cache):
        """Our cache for ``cache`` (None, a plain ``EncoderDecoderCache`` made by ``generate()``, or ours)."""
        if cache is None:
            return cls()
        if isinstance(cache, cls):
            return cache
        if isinstance(cache, EncoderDecoderCache):
            for part in (cache.self_attention_cache, cache.cross_attention_cache):
                if not isinstance(part, DynamicCache):  # transformers' StaticCache: its slots need our masks
                    raise ValueError(
                        f"hf_hardattn models decode with a HardAttnCache (growing) or a StaticHardAttnCache "
                        f"(`cache_implementation='static'`, made by generate() itself); got an EncoderDecoderCache "
                        f"holding a {type(part).__name__}; allowed `cache`: None, a HardAttnCache or StaticHardAttnCache, "
                        f"or an EncoderDecoderCache of DynamicCaches.")
            self_cache = cache.self_attention_cache
            if type(self_cache) is DynamicCache and self_cache.get_seq_length() == 0:  # generate()'s fresh cache
                self_cache = BufferedCache()
            new = cls(self_cache, cache.cross_attention_cache)
            new.is_updated = dict(cache.is_updated)
            new.seen_tokens = cache.get_seq_length()
            new._forget_past()
            return new
        raise TypeError(
            f"`cache` (`past_key_values`) must be None or an EncoderDecoderCache (e.g. HardAttnCache), got "
            f"{type(cache).__name__}."
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def set_state(self, name: str, value: torch.Tensor, per_position=None):
        """Write the per-step state ``name`` (first dimension: rows; reordered by beam search) after the call's last
        position. Decoders write states through this, never into ``states`` directly: :class:`StaticHardAttnCache`
        copies them in place. ``per_position``: the state after each of the call's positions (the last is ``value``),
        for a call of several positions: what :meth:`crop` restores inside that call."""
        self.states[name] = value
        if per_position is not None:
            self._per_position[name] = per_position

    def check_room(self, rows: int, steps: int):
        """A decoder that keeps no key/value layers calls this before a call of ``rows`` rows and ``steps`` positions
        writes anything (see :class:`StaticHardAttnCache`); a dynamic cache grows: nothing to check."""

    def advance(self, steps: int):
        """Count ``steps`` more target positions (the decoder, after each call) and keep the states after each of them
        (inside a call of several positions: those given as ``per_position``; one the call wrote only as a whole is
        not known there, one it did not write is unchanged)."""
        wrong = {name: len(values) for name, values in self._per_position.items() if len(values) != steps}
        if wrong:
            self._per_position.clear()
            raise ValueError(f"`per_position` of state(s) {wrong} (name: its length) must hold one state per position "
                             f"of the call; allowed: {steps}.")
        start = self.seen_tokens
        self.seen_tokens += steps
        before = self._past.get(start, ({}, 0))[0]
        for j in range(steps - 1):
            self._past[start + j + 1] = ({
                name: self._per_position[name][j] if name in self._per_position
                else value if before.get(name) is value else None
                for name, value in self.states.items()}, len(self._reorders))
        self._past[self.seen_tokens] = (dict(self.states), len(self._reorders))
        self._per_position.clear()

    def _order_since(self, count: int):
        """The rows' order after the reorders since the ``count``-th (row i holds what row order[i] held), or None."""
        order = None
        for beam_idx in self._reorders[count:]:
            order = beam_idx if order is None else order[beam_idx.to(order.device)]
        return order

    def _past_rows_edited(self, edit):
        """Every kept state in today's row order, then through the batch edit ``edit`` (rare: a copy of each)."""
        for position, (kept, count) in list(self._past.items()):
            order = self._order_since(count)
            self._past[position] = ({name: None if value is None else edit(
                value if order is None else value.index_select(0, order.to(value.device)))
                for name, value in kept.items()}, 0)
        self._reorders = []

    @property
    def is_linear(self) -> list[bool]:
        """No layer is a linear-attention (state-space) layer. generate() (transformers >= 5.24) cuts an already cached
        decoder prefix only when some layer is not linear, and a decoder that keeps no key/value layers (Gaussian
        self-attention, the hybrid's GRU) would otherwise report an empty list, i.e. "all linear"."""
        return [False] * max(1, len(self.self_attention_cache.layers))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self.self_attention_cache.reorder_cache(beam_idx)
        for name, state in self.states.items():
            self.states[name] = state.index_select(0, beam_idx.to(state.device))
        if self.states:  # (the kept states follow when a crop restores one)
            self._reorders.append(beam_idx)
            self._past[self.seen_tokens] = (dict(self.states), len(self._reorders))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        for states in (self.states, self.sentence_states):
            for name, state in states.items():
                states[name] = state.repeat_interleave(repeats, dim=0)
        self._past_rows_edited(lambda state: state.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        # A grouped memory's keys/values (one row per sentence, see SoftAttention) are first repeated to one row per
        # decoder row, so that `indices` select decoder rows.
        rows = next((layer.keys.shape[0] for layer in self.self_attention_cache.layers if layer.get_seq_length()),
                    next((state.shape[0] for state in self.states.values()), 0))  # decoder rows
        for layer in self.cross_attention_cache.layers:
            if layer.is_initialized and rows and layer.keys.shape[0] != rows:
                groups = rows // layer.keys.shape[0]
                layer.keys, layer.values = (t.repeat_interleave(groups, dim=0) for t in (layer.keys, layer.values))
        super().batch_select_indices(indices)
        for states in (self.states, self.sentence_states):
            for name, state in states.items():
                states[name] = state[indices]
        self._past_rows_edited(lambda state: state[indices])

    def reset(self):
        super().reset()
        self.states.clear()
        self.sentence_states.clear()
        self.seen_tokens = 0
        self._forget_past()

    @property
    def is_croppable(self) -> bool:
        """Read by transformers' assisted decoding (5.24: refused when False, after the first forward)."""
        return getattr(self.self_attention_cache, "is_croppable", True)

    def crop(self, n: int) -> None:
        """Remove the last positions (assisted decoding: rejected draft tokens); ``n`` as in :func:`cropped_length`.
        The states go back to those kept after the last position left (see :meth:`advance`)."""
        length = cropped_length(self.seen_tokens, n)
        if length < self.seen_tokens:
            self._restore(length)
        super().crop(n)
        self.seen_tokens = length

    def _restore(self, length: int):
        """The states after ``length`` positions, in today's row order; later kept states dropped."""
        kept, count = self._past.get(length, (None, 0))
        if kept is None and not self.states:
            kept = {}
        unknown = sorted(name for name, value in (kept or self.states).items() if kept is None or value is None)
        if unknown:
            raise NotImplementedError(
                f"`crop` to {length} positions (from {self.seen_tokens}; assisted decoding: `assistant_model`, "
                f"`prompt_lookup_num_tokens`) needs the decoder's state(s) {unknown} after position {length}, which "
                f"its decoder wrote only for its call of several positions as a whole. Allowed: a crop to the end of "
                f"a call, or a decoder that hands its states per position (`cache.set_state(name, value, "
                f"per_position=...)`).")
        order = self._order_since(count)
        self.states.clear()
        self.states.update({name: value if order is None else value.index_select(0, order.to(value.device))
                            for name, value in kept.items()})
        for position in [position for position in self._past if position > length]:
            del self._past[position]
        self._past[length] = (dict(self.states), len(self._reorders))


def check_static_room(rows: int, held_rows, row_limit: int, filled, steps: int, slots: int):
    """The static cache's errors for a call of ``rows`` rows and ``steps`` positions: more rows than ``max_batch_size``
    (``row_limit``), other rows than its first step's (``held_rows``; None before it), more positions than the
    ``slots`` left after the ``filled`` ones (None: not checked, as while traced)."""
    if rows > row_limit:
        raise ValueError(f"A batch of {rows} rows (sentences x beams / returned sequences) is larger than the "
                         f"static cache's `max_batch_size`={row_limit}; allowed: at most {row_limit} rows (build the "
                         f"cache for the larger batch).")
    if held_rows is not None and rows != held_rows:
        raise ValueError(f"The static cache holds {held_rows} rows since its first step, got a step of {rows} rows; "
                         f"allowed: {held_rows} (call `reset()` for a new batch).")
    if filled is not None and filled + steps > slots:
        raise ValueError(f"The static cache holds {slots} positions (`max_cache_len`) and {filled} are filled; a step "
                         f"of {steps} more does not fit; allowed: at most {slots - filled} (decode with a longer "
                         f"`max_length` / `max_cache_len`, or a dynamic cache).")


class StaticKVLayer(StaticLayer):
    """Self-attention keys/values of one decoder layer in buffers [rows, H, max_cache_len, D] allocated at the first
    step and written in place at the cache's position (transformers' ``StaticLayer``: a step's shapes never change, so
    a compiled step is one graph). ``keys`` / ``values`` are the whole buffers: the slots not yet written are hidden by
    the decoder's mask (``HardAttnDecoder.static_self_attention_mask``). Beam search reorders the rows in place."""

    def __init__(self, max_cache_len: int, max_batch_size: int):
        super().__init__(max_cache_len)
        self.row_limit, self.rows = max_batch_size, None  # (own names: StaticLayer's differ across transformers 5.x)

    def lazy_initialization(self, key_states, value_states):
        rows = key_states.shape[0]
        check_static_room(rows, None, self.row_limit, None, 0, self.max_cache_len)
        super().lazy_initialization(key_states, value_states)
        self.rows = rows

    def update(self, key_states, value_states, *args, **kwargs):
        filled = None if is_tracing() else int(self.cumulative_length)  # (eager: a sync is cheap)
        check_static_room(key_states.shape[0], self.rows if self.is_initialized else None, self.row_limit, filled,
                          key_states.shape[-2], self.max_cache_len)
        return super().update(key_states, value_states, *args, **kwargs)

    def reorder_cache(self, beam_idx):
        if self.is_initialized:  # in place: the buffers keep their address (compiled graphs, CUDA graphs)
            beam_idx = beam_idx.to(self.device)
            self.keys.copy_(self.keys.index_select(0, beam_idx))
            self.values.copy_(self.values.index_select(0, beam_idx))

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("A static cache has a fixed number of rows: `batch_repeat_interleave` is not "
                                  "possible; allowed: a dynamic cache (`cache_implementation=None`).")

    batch_select_indices = batch_repeat_interleave


class StaticKVCache(Cache):
    """The self-attention part of :class:`StaticHardAttnCache`: one :class:`StaticKVLayer` per decoder layer."""

    def __init__(self, num_layers: int, max_cache_len: int, max_batch_size: int):
        super().__init__(layers=[StaticKVLayer(max_cache_len, max_batch_size) for _ in range(num_layers)])


class StaticHardAttnCache(HardAttnCache):
    """:class:`HardAttnCache` preallocated for ``max_cache_len`` target positions of at most ``max_batch_size`` rows:
    the compileable cache of ``generate(..., cache_implementation="static")`` (``is_compileable``: generate() then
    compiles the forward of the decoding steps when a ``compile_config`` allows it).

    * self-attention keys/values: :class:`StaticKVLayer` buffers, written in place at ``position`` and masked beyond it;
    * ``position``: the target positions processed, a 0-dim int64 tensor advanced in place (a Python int would be a
      constant of a compiled graph: a new graph per step); ``get_seq_length()`` returns it, as transformers' static
      layers do;
    * cross-attention keys/values: computed once per sentence by the first (eager) step and only read after it, so a
      ``DynamicCache`` as in :class:`HardAttnCache`.

    * per-step states (``states``: recurrent cross-attention, the hybrid's RNN, Gaussian decoder self-attention's kept
      rows): allocated at the first step and copied in place after it (:meth:`set_state`); for :meth:`crop` (assisted
      decoding, prompt lookup) each also has a history, the state after every position, [max_cache_len, *state]
      preallocated beside it and written in place at each step: ``max_cache_len`` times the state's memory (e.g. a GRU
      state of rows x H per layer, a recurrent weight state of rows x heads x source length per layer). Beam reorders
      are recorded per position (one row index per row) and applied to a kept state only when a crop restores it.

    Which models decode with it is declared beside their code (``check_static_decoding``)."""

    def __init__(self, num_layers: int, max_cache_len: int, max_batch_size: int, device=None):
        for name, value in (("num_layers", num_layers), ("max_cache_len", max_cache_len),
                            ("max_batch_size", max_batch_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"`{name}`={value!r}; allowed: an int >= 1.")
        super().__init__(StaticKVCache(num_layers, max_cache_len, max_batch_size), DynamicCache())
        self._max_cache_len, self._max_batch_size = max_cache_len, max_batch_size
        self.position = torch.zeros((), dtype=torch.long, device=device)
        if not is_tracing():
            torch._dynamo.mark_static_address(self.position)
        self._forget_history()

    def _forget_history(self):
        # name -> [max_cache_len, *state]: index i holds the state after position i + 1 (written from index start on)
        self._history: dict[str, torch.Tensor] = {}
        self._history_start: dict[str, int] = {}
        self._written: dict[str, int | None] = {}  # eager: name -> the current call's per_position length (or None)
        self._unknown: dict[str, set[int]] = {}  # name -> positions inside a call of several written as a whole
        # [max_cache_len + 1, rows] (allocated at the first reorder): the composed beam reorders made at position q,
        # which the states after positions <= q follow
        self._reorders: torch.Tensor | None = None

    # properties: transformers' ``Cache`` defines both, read-only, in some 5.x releases
    @property
    def max_cache_len(self) -> int:
        """The target positions it holds."""
        return self._max_cache_len

    @property
    def max_batch_size(self) -> int:
        """The rows it holds."""
        return self._max_batch_size

    def get_seq_length(self, layer_idx: int = 0):
        return self.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def check_room(self, rows: int, steps: int):
        """The errors that key/value slots give a call (:func:`check_static_room`), for a decoder that keeps none (the
        hybrid's RNN): called before the call writes anything; eager only."""
        if not is_tracing():
            held = next((state.shape[0] for state in self.states.values()), None)
            check_static_room(rows, held, self.max_batch_size, int(self.position), steps, self.max_cache_len)

    def advance(self, steps: int):
        """Count ``steps`` more target positions (in place: the tensor keeps its address). Eager, after a call of several
        positions: a state written as a whole (no ``per_position``) is kept after the call's last position, and is
        unknown inside the call (a crop there is refused); ``per_position`` of another length is refused."""
        if not is_tracing():
            written, start = dict(self._written), int(self.position)
            self._written.clear()
            wrong = {name: count for name, count in written.items() if count is not None and count != steps}
            if wrong:
                raise ValueError(f"`per_position` of state(s) {wrong} (name: its length) must hold one state per "
                                 f"position of the call; allowed: {steps}.")
            for name, count in written.items():
                unknown = {p for p in self._unknown.get(name, ()) if p <= start}  # (later ones are rewritten now)
                if count is None and steps > 1:  # written once, at the index of the call's first position
                    self._history[name][start + steps - 1].copy_(self.states[name])
                    unknown.update(range(start + 1, start + steps))
                self._unknown[name] = unknown
        self.position.add_(steps)

    def set_state(self, name: str, value: torch.Tensor, per_position=None):
        """The first write of ``name`` (the eager first step) allocates its buffer and history; later writes copy into
        them in place, so a state must keep its shape and dtype from step to step (a compiled step reads the same
        buffers). ``per_position``: the state after each of the call's positions (the last is ``value``), written into
        the history for :meth:`crop`; without it the call is one position."""
        state = self.states.get(name)
        if state is None:
            if is_tracing():
                raise ValueError(f"The static cache's state {name!r} was not written by the first (eager) decoding "
                                 f"step; allowed: states allocated at the first step.")
            self.states[name] = state = value.detach().clone()
            self._history[name] = value.new_zeros((self.max_cache_len, *value.shape))
            self._history_start[name] = int(self.position)
            for buffer in (state, self._history[name]):
                torch._dynamo.mark_static_address(buffer)
        elif state.shape != value.shape or state.dtype != value.dtype:
            raise ValueError(f"The static cache's state {name!r} is {state.dtype} {tuple(state.shape)} since its first "
                             f"step, got {value.dtype} {tuple(value.shape)}; allowed: the same shape and dtype at every "
                             f"step (call `reset()` for a new batch).")
        else:
            state.copy_(value)
        steps = [value] if per_position is None else per_position
        if not is_tracing():
            self._written[name] = None if per_position is None else len(per_position)
        indices = self.position + torch.arange(len(steps), device=self.position.device)  # state after p + 1 -> p
        self._history[name].index_copy_(0, indices, torch.stack([step.detach() for step in steps]))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Keys/values and states reordered in place (the buffers keep their address); the reorder is recorded at the
        position (composed with one made there before) for the kept states, which :meth:`crop` reorders."""
        self.self_attention_cache.reorder_cache(beam_idx)
        for state in self.states.values():
            state.copy_(state.index_select(0, beam_idx.to(state.device)))
        if self.states:
            beam_idx = beam_idx.to(self.position.device)
            if self._reorders is None:
                rows = torch.arange(len(beam_idx), device=beam_idx.device)
                self._reorders = rows.repeat(self.max_cache_len + 1, 1)
            at = self.position.view(1)
            composed = self._reorders.index_select(0, at)[0].index_select(0, beam_idx)
            self._reorders.index_copy_(0, at, composed[None])

    def reset(self):
        """Empty for a new call of the same shapes: the keys/values keep their address (zeroed in place, the position
        set to 0), so that graphs compiled for it (inductor's freezing, CUDA graphs) stay valid; the states and their
        histories are dropped (the first step computes the initial states and writes them anew)."""
        super().reset()
        self._forget_history()
        self.position.zero_()

    def crop(self, n: int) -> None:
        """Remove the last positions (``n`` < 0: that many; 0: none); the slots stay allocated and are overwritten.
        The states go back, in place, to those after the last position left (their history, in today's row order);
        a crop to position 0 drops them (the next step starts from the initial states)."""
        if n > 0:
            raise ValueError(f"`crop` of a static cache takes minus the number of positions to remove (<= 0), got {n}.")
        removed = min(-n, int(self.position))
        if removed and self.states:
            self._restore(int(self.position) - removed)
        for layer in self.self_attention_cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.sub_(removed)
        self.position.sub_(removed)

    def _restore(self, length: int):
        """The states after ``length`` positions, in place and in today's row order, from their histories; the reorders
        recorded after it folded into the one before it (which the earlier kept states still follow)."""
        if length == 0:
            self.states.clear()
            self._forget_history()
            return
        unknown = sorted(name for name, start in self._history_start.items()
                         if length <= start or length in self._unknown.get(name, ()))
        if unknown:
            raise NotImplementedError(
                f"`crop` to {length} positions (from {int(self.position)}; assisted decoding: `assistant_model`, "
                f"`prompt_lookup_num_tokens`) needs the static cache's state(s) {unknown} after position {length}, "
                f"which its decoder did not write there (before its first write, or inside a call of several positions "
                f"written as a whole). Allowed: a crop to the end of a call, or a decoder that hands its states per "
                f"position (`cache.set_state(name, value, per_position=...)`).")
        for name, positions in self._unknown.items():
            self._unknown[name] = {p for p in positions if p <= length}
        order = None
        if self._reorders is not None:
            end = int(self.position)
            for made in self._reorders[length : end + 1]:  # the reorders the state after `length` follows
                order = made if order is None else order[made]
            self._reorders[length - 1] = self._reorders[length - 1][order]
            self._reorders[length : end + 1] = torch.arange(self._reorders.shape[1], device=order.device)
        for name, state in self.states.items():
            kept = self._history[name][length - 1]
            state.copy_(kept if order is None else kept.index_select(0, order.to(kept.device)))
            kept.copy_(state)

    @property
    def is_croppable(self) -> bool:
        """Keys/values, and states through their histories: yes."""
        return True

    def batch_repeat_interleave(self, repeats: int):
        self.self_attention_cache.layers[0].batch_repeat_interleave(repeats)  # (refused: fixed rows)

    batch_select_indices = batch_repeat_interleave


__all__ = ["CACHE_FIELD", "CROP_KEEPS_LENGTH", "BufferedCache", "BufferedLayer", "HardAttnCache", "StaticHardAttnCache",
           "StaticKVCache", "StaticKVLayer", "check_static_room", "cropped_length"]
