"""Hugging Face checkpoints as every layer loads them: the model, its tokenizer, and where they live.

`resolve_checkpoint` accepts a checkpoint directory (`config.json` in it) or a run directory whose
`final/` is one, so `postrain eval --checkpoint runs/NAME` and `--checkpoint runs/NAME/final` agree.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.errors import UserError


def is_checkpoint(path: Path) -> bool:
    """An HF model directory: its config.json names a `model_type` (a run's own config.json does not)."""
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def resolve_checkpoint(path: str | Path) -> Path:
    """The HF checkpoint directory that `path` names: `path` itself, or `path/final` of a run directory."""
    path = Path(path)
    for candidate in (path, path / "final"):
        if is_checkpoint(candidate):
            return candidate
    if not path.exists():
        raise UserError(f"checkpoint {path}: no such directory; expected an HF checkpoint directory "
                        "(config.json + safetensors) or a run directory holding one as final/")
    raise UserError(f"checkpoint {path}: neither {path} nor {path}/final holds an HF model config.json; "
                    "expected an HF checkpoint directory (written by `postrain sft`, `postrain grpo` or "
                    "`save_pretrained`) or a run directory holding one as final/")


# Config settings that change the logits after hidden @ W.T, each with the value that changes nothing.
LOGIT_TRANSFORMS = {"logit_scale": 1.0, "logits_scaling": 1.0, "lm_head_multiplier": 1.0,
                    "final_logit_softcapping": None}


def logit_transform(cfg: dict, head_bias: bool = False) -> str | None:
    """The setting by which a model's logits are not hidden @ W.T (a scale, a softcap, a head bias),
    or None. The learner and the OPD losses rebuild logits from hidden states as hidden @ W.T."""
    for section in (cfg, cfg.get("text_config") or {}):
        for key, neutral in LOGIT_TRANSFORMS.items():
            if section.get(key, neutral) != neutral:
                return f"{key} = {section[key]}"
    return "a bias in its output head" if head_bias else None


def check_plain_logits(cfg: dict, head_bias: bool, what: str) -> None:
    """UserError naming `what` and the setting when its logits are not hidden @ W.T."""
    found = logit_transform(cfg, head_bias)
    if found:
        raise UserError(f"{what}: its logits are not hidden states @ output head ({found}); the learner's fused "
                        "head would compute wrong log-probs, so this model is not supported")


def check_model_logits(model, what: str) -> None:
    """`check_plain_logits` of a built model: its config and its output head's bias."""
    check_plain_logits(model.config.to_dict(), getattr(model.get_output_embeddings(), "bias", None) is not None, what)


def load_tokenizer(path: str | Path):
    """The tokenizer saved in checkpoint directory `path`.

    `AutoTokenizer` prefers the model type's own tokenizer class (Qwen2Tokenizer for a qwen2 config),
    which rebuilds the pre-tokenizer and silently drops our spaces; a tokenizer saved as a plain
    tokenizers backend is therefore loaded as exactly that.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = Path(path) / "tokenizer_config.json"
    cls = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.is_file() else None
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_policy(path: str | Path, dtype=None):
    """Model and tokenizer from an HF checkpoint directory (safetensors), or a run directory's final/.
    UserError, naming the checkpoint, when it does not load, or when its weights do not fit its config
    (a tensor missing, left over or of another shape): such a model would be partly random."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_checkpoint(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="sdpa",
                                                           use_safetensors=True, output_loading_info=True)
    except Exception as exc:  # a truncated safetensors file, a config value the model class cannot build with
        raise UserError(f"checkpoint {path}: does not load ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})") from exc
    bad = {k: sorted(map(str, info.get(k) or ()))[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        raise UserError(f"checkpoint {path}: its weights do not fit its config.json "
                        + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in bad.items() if v))
    check_model_logits(model, f"checkpoint {path}")
    return model, load_tokenizer(path)


def save_policy(model, tok, path: str | Path) -> Path:
    """Weights as safetensors and the tokenizer, into `path`."""
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
