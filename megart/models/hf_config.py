"""A Hugging Face config.json -> LlamaConfig, refusing what megart cannot run before anything is allocated.

Supported: LlamaForCausalLM (Llama 3.0 / 3.1 / 3.2 conventions) and Qwen3ForCausalLM (per-head q/k
RMSNorm). Each refusal names the config field and its value. Both spellings of RoPE settings are read:
`rope_theta` + `rope_scaling` (checkpoints on the Hub) and `rope_parameters` (what transformers 5 writes).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..tasks.attention_common import ATTN_HD, ATTN_MAX_GROUP, QKV_MAX_D
from ..tasks.dense_common import MAX_K
from .llama_config import LlamaConfig

__all__ = ["CheckpointError", "SUPPORTED_ARCHITECTURES", "read_config", "config_from_hf", "eos_token_ids"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
READABLE_DTYPES = ("bfloat16", "float16", "float32")


class CheckpointError(ValueError):
    """A model folder megart cannot load: names the file, tensor, config field or value at fault."""


def read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder}: not a directory (expected a Hugging Face model folder)")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a Hugging Face model folder has a config.json)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _refuse(field: str, value, why: str):
    raise CheckpointError(f"config.json: {field} = {value!r} is not supported ({why})")


def _need(hf: dict, field: str):
    if field not in hf:
        raise CheckpointError(f"config.json: required field {field!r} is missing")
    return hf[field]


def _rope(hf: dict) -> tuple[float, tuple]:
    """(theta, llama3 scaling tuple or ()) from either spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):       # transformers 5: theta and the scaling in one dict
        field, scaling = "rope_parameters", params
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        field, scaling = "rope_scaling", hf.get("rope_scaling")
        theta = hf.get("rope_theta", 10000.0)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), ()
    if kind != "llama3":
        _refuse(f"{field}.rope_type", kind, "only 'llama3' scaling or none")
    try:
        vals = tuple(float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"))
    except KeyError as e:
        raise CheckpointError(f"config.json: {field} of type llama3 lacks {e.args[0]!r}") from None
    if not vals[2] > vals[1] > 0 or vals[0] <= 0:
        _refuse(field, scaling, "llama3 needs factor > 0 and high_freq_factor > low_freq_factor > 0")
    return float(theta), vals


def config_from_hf(hf: dict, *, max_seq: int = 4096, weights: str = "bf16", name: str = "hf") -> LlamaConfig:
    """The LlamaConfig of a supported checkpoint config (a parsed config.json). Raises CheckpointError naming
    the first unsupported field."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        _refuse("architectures", archs, f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if "quantization_config" in hf:
        _refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                "pre-quantised checkpoints are not read; weights='fp8' quantises on load")
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype is not None and dtype not in READABLE_DTYPES:
        _refuse("dtype" if "dtype" in hf else "torch_dtype", dtype, f"readable: {', '.join(READABLE_DTYPES)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "the MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            _refuse(field, hf[field], "no biases")
    if hf.get("use_sliding_window", False):
        _refuse("use_sliding_window", True, "full attention only")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        _refuse("layer_types", sorted(set(layer_types)), "full attention in every layer only")
    if hf.get("pretraining_tp", 1) != 1:
        _refuse("pretraining_tp", hf["pretraining_tp"], "only 1")

    d = int(_need(hf, "hidden_size"))
    n_q = int(_need(hf, "num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_q)
    hd = int(hf.get("head_dim") or d // n_q)
    layers = int(_need(hf, "num_hidden_layers"))
    ffn = int(_need(hf, "intermediate_size"))
    vocab = int(_need(hf, "vocab_size"))
    if hd not in ATTN_HD:
        _refuse("head_dim", hd, f"one of {ATTN_HD}")
    if n_kv < 1 or n_q % n_kv or not 1 <= n_q // n_kv <= ATTN_MAX_GROUP:
        _refuse("num_key_value_heads", n_kv, f"num_attention_heads ({n_q}) / it must be a whole group of 1 to "
                                             f"{ATTN_MAX_GROUP}")
    if d % 8 or not 8 <= d <= QKV_MAX_D:
        _refuse("hidden_size", d, f"a multiple of 8 up to {QKV_MAX_D}")
    if ffn % 16 or not 16 <= ffn <= MAX_K:
        _refuse("intermediate_size", ffn, f"a multiple of 16 up to {MAX_K} (the down projection stages it whole)")
    if layers < 1 or vocab < 1:
        _refuse("num_hidden_layers" if layers < 1 else "vocab_size", layers if layers < 1 else vocab, "must be >= 1")
    eps = float(hf.get("rms_norm_eps", 1e-5))
    if not eps > 0:
        _refuse("rms_norm_eps", eps, "must be > 0")
    theta, llama3 = _rope(hf)
    if weights not in ("bf16", "fp8"):
        raise CheckpointError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
    if int(max_seq) < 2:
        raise CheckpointError(f"max_seq must be >= 2, got {max_seq}")
    tied = bool(hf.get("tie_word_embeddings", False))
    return LlamaConfig(name=name, layers=layers, d=d, ffn=ffn, n_q=n_q, n_kv=n_kv, hd=hd, vocab=vocab, tied=tied,
                       eps=eps, theta=theta, prefill=0, max_seq=int(max_seq), wdtype=weights, rope_llama3=llama3,
                       qk_norm=arch == "Qwen3ForCausalLM")


def eos_token_ids(folder, hf: dict) -> set[int]:
    """End-of-sequence ids: generation_config.json's when present (chat checkpoints list several), else
    config.json's."""
    ids = hf.get("eos_token_id")
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        try:
            with open(gen) as f:
                ids = json.load(f).get("eos_token_id", ids)
        except (OSError, ValueError):
            pass                       # optional file: a broken one falls back to config.json's ids
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, list) else [ids])}
