import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_hardattn_cli.command import main
from test_train_cli import SIZES, data  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_card_on_local_data_names_no_dataset_id(data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    argv = ["train", "--train", str(data / "train"), "--validation", str(data / "valid"), "--source-lang", "en",
            "--target-lang", "de", "--model-type", "soft_transformer", *SIZES, "--output-dir", str(out), "--quiet",
            "--threads", "1", "--max-steps", "2", "--num-beams", "1", "--tokenizer-kind", "char", "--vocab-size", "40"]
    assert main(argv) == 0
    card = ModelCard((out / "model" / "README.md").read_text())
    _, evals = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert {(e.dataset_type, e.dataset_name, e.dataset_split) for e in evals} == {("local:valid", "valid",
                                                                                  "validation")}
    with pytest.raises(HFValidationError):
        validate_repo_id(evals[0].dataset_type)
    assert card.data.datasets is None
