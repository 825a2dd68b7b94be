"""Write a draft model for speculative decoding made of a model's first layers (its embedding, its
first N decoder layers, its final norm and its LM head), as a Hugging Face directory.

An early-exit draft of this kind (the idea behind LayerSkip's self-speculation) shares the target's
tokenizer by construction and costs N / L of a target step. It was never trained to stop early, so
it agrees with the target less often than a trained small model would; it is what this offline
machine can make for measuring the ``draft_model`` method (docs/speculative-decoding.md).

    python scripts/make_layer_draft.py --layers 8 --out /tmp/smollm2-draft-8
    pagedserve serve --speculative-config '{"model": "/tmp/smollm2-draft-8", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM

from pagedserve.models.default_model import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a .gguf file or Hugging Face directory (default: the default model)"
    )
    parser.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps (from the first)")
    parser.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args()
    path = args.model or default_model_path()
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, local_files_only=True
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    total = model.config.num_hidden_layers
    if not 1 <= args.layers < total:
        parser.error(f"--layers must be between 1 and {total - 1} for a model of {total} layers")
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    model.save_pretrained(args.out)
    print(f"{args.out}: the first {args.layers} of {total} layers of {path}")


if __name__ == "__main__":
    main()
