"""OPD teachers: which HF causal-LM checkpoint serves which domain, with which weight, checked before
any work starts.

A teacher is named `DOMAIN:INDEX` (`arith:0`), the name the data plane keeps as `teacher_id`. Checks:
every domain to be sampled has a teacher; every teacher resolves to a checkpoint whose safetensors hold
its output head; its tokenizer equals the student's (same vocabulary, same special tokens) and its
vocabulary size is the student's. Teachers may differ from the student in width and depth. The
weights' fingerprint (sha256 of the safetensors files) names the exact weights a cache entry was
computed with.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from core.errors import UserError
from core.hf import check_plain_logits, resolve_checkpoint

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class Teacher:
    name: str  # DOMAIN:INDEX
    domain: str
    path: str  # the resolved checkpoint directory
    weight: float  # w_i of sum_i w_i KL(student || teacher_i)
    fingerprint: str  # sha256 over the weights files
    hidden_size: int
    vocab_size: int
    head_key: str  # the output head's tensor in the safetensors files
    head_file: str  # which safetensors file holds it

    def to_json(self) -> dict:
        return asdict(self)


def parse_teacher_arg(text: str) -> tuple[str, str, float]:
    """`DOMAIN=DIR` or `DOMAIN:WEIGHT=DIR` (the form of `--teacher`) -> (domain, dir, weight)."""
    key, sep, path = text.partition("=")
    if not sep or not key or not path:
        raise UserError(f"--teacher {text!r}: expected DOMAIN=DIR or DOMAIN:WEIGHT=DIR, e.g. arith=runs/arith")
    domain, _, raw_weight = key.partition(":")
    try:
        weight = float(raw_weight) if raw_weight else 1.0
    except ValueError:
        raise UserError(f"--teacher {text!r}: weight {raw_weight!r} is not a number") from None
    return domain, path, weight


def table_entries(table: dict) -> list[tuple[str, str, float]]:
    """`[opd.teachers]` entries: `arith = "DIR"` or `arith = [{path = "DIR", weight = 0.5}, ...]`."""
    out = []
    for domain, value in table.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str):
                out.append((domain, item, 1.0))
            elif isinstance(item, dict) and isinstance(item.get("path"), str):
                out.append((domain, item["path"], float(item.get("weight", 1.0))))
            else:
                raise UserError(f"[opd.teachers] {domain}: expected a path or {{path = ..., weight = ...}}, got {item!r}")
    return out


def weights_fingerprint(ckpt: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(ckpt.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def tokenizer_signature(ckpt: Path) -> dict:
    """What must agree between teacher and student: the full vocabulary (added tokens included) and the
    special tokens."""
    from tokenizers import Tokenizer

    path = ckpt / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing")
    vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items() if k in SPECIAL_KEYS}
    return {"vocab": vocab, "special": special}


def _find_tensor(ckpt: Path, key: str) -> tuple[str, tuple[int, ...]] | None:
    """(file, shape) of tensor `key` in the checkpoint's safetensors files, or None."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if key in st.keys():
                return f.name, tuple(st.get_slice(key).get_shape())
    return None


def _full_config(ckpt: Path, cfg: dict) -> dict:
    """config.json `cfg` with its model class's defaults filled in (a file written by hand may leave out a
    default logit scale); as written where the class does not build it (an unknown model type)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(ckpt).to_dict()
    except Exception:  # transformers raises many types for a config it cannot build
        return cfg


def _head_location(ckpt: Path, cfg: dict) -> tuple[str, str, tuple[int, ...]]:
    """(file, tensor key, shape) of the output head (the tied embedding when the head is tied)."""
    keys = ("lm_head.weight", "model.embed_tokens.weight") if not cfg.get("tie_word_embeddings") else \
        ("model.embed_tokens.weight", "lm_head.weight")
    for key in keys:
        found = _find_tensor(ckpt, key)
        if found:
            return found[0], key, found[1]
    raise KeyError(f"no output head ({' or '.join(keys)}) in {ckpt}")


def describe(domain: str, index: int, path: str, weight: float) -> Teacher:
    """One teacher, loaded as far as needed to check it (config, head shape, fingerprint)."""
    name = f"{domain}:{index}"
    try:
        ckpt = resolve_checkpoint(path)
    except UserError as exc:
        raise UserError(f"teacher {name}: {exc}") from None
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
        head_file, head_key, shape = _head_location(ckpt, cfg)
        head_bias = _find_tensor(ckpt, "lm_head.bias") is not None
        full_cfg = _full_config(ckpt, cfg)
    except (OSError, ValueError, KeyError, Exception) as exc:  # safetensors raises its own error types
        raise UserError(f"teacher {name} ({ckpt}): cannot read its weights: {exc}") from None
    check_plain_logits(full_cfg, head_bias, f"teacher {name} ({ckpt})")  # its logits are rebuilt as h @ W.T
    vocab, hidden = int(cfg.get("vocab_size", shape[0])), int(cfg.get("hidden_size", shape[1]))
    if shape != (vocab, hidden):
        raise UserError(f"teacher {name} ({ckpt}): output head {head_key} has shape {shape}, config says "
                        f"vocab {vocab} x hidden {hidden}")
    if not weight > 0:
        raise UserError(f"teacher {name}: weight must be > 0, got {weight}")
    return Teacher(name, domain, str(ckpt), float(weight), weights_fingerprint(ckpt), hidden, vocab, head_key, head_file)


def resolve_teachers(entries: list[tuple[str, str, float]], student: str | Path, domains: list[str],
                     known_domains: list[str]) -> list[Teacher]:
    """Check every entry against the student and the domains; one clear error naming the teacher."""
    student = resolve_checkpoint(student)
    for domain, _, _ in entries:
        if domain not in known_domains:
            raise UserError(f"teacher for unknown domain {domain!r}; known: {', '.join(known_domains)}")
    missing = [d for d in domains if d not in {e[0] for e in entries}]
    if missing:
        raise UserError(f"no teacher for domain(s) {', '.join(missing)}: pass --teacher {missing[0]}=DIR")
    student_cfg = json.loads((student / "config.json").read_text())
    student_tok = tokenizer_signature(student)
    teachers, index = [], {}
    for domain, path, weight in entries:
        t = describe(domain, index.setdefault(domain, 0), path, weight)
        index[domain] += 1
        if t.vocab_size != int(student_cfg["vocab_size"]):
            raise UserError(f"teacher {t.name} ({t.path}): vocabulary size {t.vocab_size} differs from the "
                            f"student's {student_cfg['vocab_size']}")
        try:
            sig = tokenizer_signature(Path(t.path))
        except (OSError, ValueError, Exception) as exc:
            raise UserError(f"teacher {t.name} ({t.path}): cannot read its tokenizer: {exc}") from None
        if sig != student_tok:
            diff = sorted(set(sig["vocab"].items()) ^ set(student_tok["vocab"].items()))[:3]
            what = f"vocabulary differs (e.g. {diff})" if diff else f"special tokens differ ({sig['special']} vs " \
                                                                    f"{student_tok['special']})"
            raise UserError(f"teacher {t.name} ({t.path}): tokenizer is not the student's: {what}")
        teachers.append(t)
    return teachers
