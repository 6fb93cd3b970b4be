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
