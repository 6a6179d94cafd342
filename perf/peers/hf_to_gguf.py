"""Run llama.cpp's convert_hf_to_gguf.py with a BPE pre-tokenizer fallback.

    python perf/peers/hf_to_gguf.py --llama-src SRC --pre qwen2 -- MODEL_DIR --outfile X.gguf

Fixture tokenizers are trained locally, so their pre-tokenizer hash is not in llama.cpp's list
and the converter raises "BPE pre-tokenizer was not recognized". This wrapper patches
TextModel.get_vocab_base_pre in memory (no llama.cpp file is edited): a recognised hash keeps
llama.cpp's answer, an unknown one gets --pre. Everything after "--" goes to the converter.
"""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

log = logging.getLogger("hf_to_gguf")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        ours, theirs = argv[:cut], argv[cut + 1 :]
    else:
        ours, theirs = argv, []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-src", type=Path, required=True, help="unpacked llama.cpp tree")
    parser.add_argument("--pre", required=True, help="pre-tokenizer name, e.g. qwen2, llama-bpe")
    parser.add_argument("--force", action="store_true", help="use --pre even for known hashes")
    return parser.parse_args(ours), theirs


def patch_pre_tokenizer(pre: str, force: bool) -> None:
    """Make every TextModel fall back to (or always use) the named pre-tokenizer."""
    from conversion.base import TextModel  # from --llama-src, put on sys.path by main()

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        if force:
            return pre
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            log.warning("pre-tokenizer hash not recognised; using %r (cpud override)", pre)
            return pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    src = args.llama_src.resolve()
    script = src / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    patch_pre_tokenizer(args.pre, args.force)
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
