"""Translate with a saved model through ``AutoModelForSeq2SeqLM`` and the ``translation`` pipeline.

``import hf_hardattn`` registers every model type with the Auto classes and the ``translation`` pipeline task
(transformers 5 has none of its own); the pipeline serves stock seq2seq models (MarianMTModel, BART) as well.

    python examples/translate.py my-model "A dog runs on the beach." "Two men are playing football."
    python examples/translate.py my-model --input test.en --output hyp.de --num-beams 4 --batch-size 32
    echo "A dog runs." | python examples/translate.py you/my-model      # a Hub id works as well as a folder
"""

import argparse
import sys

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

import hf_hardattn  # noqa: F401  (registers the model types and the translation task)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved model folder or a Hub id (with its tokenizer)")
    parser.add_argument("sentences", nargs="*", help="sentences to translate (default: --input, else stdin)")
    parser.add_argument("--input", help="a file with one sentence a line")
    parser.add_argument("--output", help="write the translations here, one a line (default: stdout)")
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: the model's generation config")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.sentences:
        sentences = args.sentences
    else:
        with open(args.input, encoding="utf-8") if args.input else sys.stdin as handle:
            sentences = [line.rstrip("\n") for line in handle]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(args.device).eval()
    translator = pipeline("translation", model=model, tokenizer=tokenizer, device=args.device)

    generate_kwargs = dict(num_beams=args.num_beams)
    if args.max_new_tokens is not None:
        generate_kwargs["max_new_tokens"] = args.max_new_tokens
    outputs = translator(sentences, batch_size=args.batch_size, **generate_kwargs)
    translations = [output["translation_text"] for output in outputs]

    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in translations)
    else:
        for line in translations:
            print(line)
    return translations


if __name__ == "__main__":
    main()
