"""The checkpoint folder's own tokenizer: transformers' AutoTokenizer when installed (it knows each model's
special-token conventions, e.g. Llama's BOS), else the `tokenizers` library on tokenizer.json. Both are
optional (`pip install megart[hf]`); only text in / text out needs them."""
from __future__ import annotations

from pathlib import Path

from .hf_config import CheckpointError

__all__ = ["Tokenizer", "load_tokenizer"]


class Tokenizer:
    """encode(text) -> ids (with the model's special tokens), decode(ids) -> text."""

    def __init__(self, impl, kind: str):
        self._impl = impl
        self.kind = kind          # "transformers" | "tokenizers"

    def encode(self, text: str) -> list[int]:
        if self.kind == "transformers":
            return list(self._impl(text)["input_ids"])
        return list(self._impl.encode(text).ids)

    def decode(self, ids) -> str:
        return self._impl.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(folder) -> Tokenizer:
    folder = Path(folder)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), "transformers")
        except (OSError, ValueError) as e:
            if not (folder / "tokenizer.json").is_file():
                raise CheckpointError(f"{folder}: no tokenizer transformers can load ({e})") from None
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (text in / text out needs the checkpoint's tokenizer)")
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError:
        raise CheckpointError("reading the tokenizer needs `tokenizers` or `transformers` "
                              "(pip install 'megart[hf]')") from None
    try:
        return Tokenizer(RawTokenizer.from_file(str(path)), "tokenizers")
    except Exception as e:        # tokenizers raises its own exception type for a malformed file
        raise CheckpointError(f"{path}: not a readable tokenizer ({e})") from None
