"""Publish a saved model on the Hugging Face Hub with ``push_to_hub``.

One commit holds the weights, the config, the modeling code (so that the repo loads with
``AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)`` where hf_hardattn is not installed), the
package's model card and the tokenizer. ``--dry-run`` writes what would be uploaded to a local folder and pushes
nothing.

    hf auth login                                                   # or HF_TOKEN=...
    python examples/publish.py my-model --repo-id you/my-model --dry-run
    python examples/publish.py my-model --repo-id you/my-model --private --commit-message "first version"

``hf-hardattn publish`` does the same and also checks, in a fresh process without the package, that the upload
folder loads and decodes as the model does (and adds run metrics to the card).
"""

import argparse
import os
import tempfile

import huggingface_hub
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401  (registers the model types)
from hf_hardattn.model_card import name_repo


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a folder saved with save_pretrained (with its tokenizer)")
    parser.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME on the Hub")
    parser.add_argument("--dry-run", action="store_true", help="build the upload folder locally, push nothing")
    parser.add_argument("--dry-run-dir", default=None, help="where --dry-run writes (default: a temporary folder)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--commit-message", default="Upload model")
    parser.add_argument("--token", default=None, help="default: the login's token (HF_TOKEN)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not args.dry_run and huggingface_hub.constants.HF_HUB_OFFLINE:
        raise SystemExit("HF_HUB_OFFLINE is set: nothing can be pushed (unset it, or use --dry-run)")
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    if args.dry_run:
        folder = args.dry_run_dir or tempfile.mkdtemp(prefix="publish-")
        model.save_pretrained(folder, tokenizer=tokenizer)  # what push_to_hub uploads, ...
        card = os.path.join(folder, "README.md")  # ... whose card's snippets load the repo pushed to
        with open(card, encoding="utf-8") as handle:
            text = name_repo(handle.read(), args.repo_id)
        with open(card, "w", encoding="utf-8") as handle:
            handle.write(text)
        files = sorted(os.listdir(folder))
        print(f"dry run: {args.repo_id} would get {len(files)} files (written to {folder}); nothing pushed")
        for name in files:
            print(f"  {name:32} {os.path.getsize(os.path.join(folder, name)):>12,} bytes")
        return files

    commit = model.push_to_hub(args.repo_id, tokenizer=tokenizer, commit_message=args.commit_message,
                               private=args.private, token=args.token)
    print(f"pushed {args.model} to https://huggingface.co/{args.repo_id} ({commit.commit_message!r})")
    return commit


if __name__ == "__main__":
    main()
