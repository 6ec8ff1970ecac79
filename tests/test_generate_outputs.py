"""The tensors generate() returns, as other code reads them: contiguous for every model type and decoding mode, so that
they go back into a model as ``labels=`` (MarianMTModel's loss reads ``labels.view(-1)``, which a strided view refuses).

Reference: the same ids rebuilt as a fresh tensor (``torch.tensor(ids.tolist())``, contiguous by construction) give
MarianMTModel the same loss.
"""

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

from common import generate_kwargs, source_batch, tiny_kwargs
from hf_hardattn.registry import MODEL_TYPES, model_classes

RNN_KW = dict(decoder_layers=1, rnn_hidden_size=32)


def tiny_model(model_type):
    config_class, model_class = model_classes(model_type)
    rnn = MODEL_TYPES[model_type].rnn_decoder
    torch.manual_seed(0)
    return model_class(config_class(**tiny_kwargs(**(RNN_KW if rnn else {})))).eval()


@pytest.fixture(scope="module")
def marian():
    torch.manual_seed(0)
    return MarianMTModel(MarianConfig(**tiny_kwargs())).eval()


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_generated_sequences_are_contiguous_and_serve_as_marian_labels(model_type, marian):
    model = tiny_model(model_type)
    ids, mask = source_batch()
    modes = {mode: generate_kwargs(mode) for mode in ("greedy", "beam", "sample")}
    modes["beam, one sequence"] = dict(num_beams=4, max_new_tokens=6)  # the case transformers crops into a view
    modes["beam, dict"] = dict(num_beams=4, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    for mode, kwargs in modes.items():
        torch.manual_seed(1234)
        with torch.no_grad():
            output = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        sequences = output.sequences if kwargs.get("return_dict_in_generate") else output
        assert sequences.is_contiguous(), (mode, sequences.stride())
        if kwargs.get("return_dict_in_generate"):
            assert output.beam_indices.is_contiguous(), (mode, output.beam_indices.stride())
        rows = sequences.shape[0] // ids.shape[0]
        inputs = dict(input_ids=ids.repeat_interleave(rows, 0), attention_mask=mask.repeat_interleave(rows, 0))
        with torch.no_grad():
            loss = marian(**inputs, labels=sequences).loss
            expected = marian(**inputs, labels=torch.tensor(sequences.tolist())).loss
        assert torch.equal(loss, expected), mode
