"""A character-level tokenizer built with the `tokenizers` library and saved as a HF fast tokenizer.

Every printable ASCII character and newline is one token; `<pad>`, `<eos>`, `<unk>` are specials.
Saved with `save_pretrained`, so any component loads it (or a real model's tokenizer) with
`AutoTokenizer.from_pretrained(dir)`.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left",
        model_max_length=4096,
    )


def load_tokenizer(path):
    """The tokenizer saved in checkpoint dir `path`.

    `AutoTokenizer` prefers the model type's own tokenizer class (Qwen2Tokenizer for a qwen2 config),
    which rebuilds the pre-tokenizer and silently drops our spaces; a tokenizer saved as a plain
    tokenizers backend is therefore loaded as exactly that.
    """
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    cfg_path = Path(path) / "tokenizer_config.json"
    cls = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.is_file() else None
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
