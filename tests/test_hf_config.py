"""config.json -> LlamaConfig: the supported conventions, and every refusal naming its field and value."""
from __future__ import annotations

import pytest
import torch

from megart.models.hf_config import CheckpointError, config_from_hf, eos_token_ids, read_config
from megart.models.llama_config import rope_inv_freq

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
         "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
         "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16",
         "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}


def test_llama_3_2_3b_config():
    c = config_from_hf(LLAMA, max_seq=4096)
    assert (c.layers, c.d, c.ffn, c.n_q, c.n_kv, c.hd, c.vocab, c.group) == (28, 3072, 8192, 24, 8, 128, 128256, 3)
    assert c.tied and not c.qk_norm and c.theta == 500000.0 and c.eps == 1e-5 and c.prefill == 0
    assert c.rope_llama3 == (32.0, 1.0, 4.0, 8192.0) and c.max_seq == 4096


def test_transformers_5_rope_parameters_and_qwen3():
    hf = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
          "tie_word_embeddings": False, "layer_types": ["full_attention"] * 28, "use_sliding_window": False,
          "sliding_window": None}
    del hf["rope_scaling"], hf["rope_theta"]
    c = config_from_hf(hf)
    assert c.qk_norm and not c.tied and c.theta == 1e6 and c.rope_llama3 == ()


def test_head_dim_defaults_to_hidden_over_heads():
    hf = {**LLAMA, "hidden_size": 2048, "num_attention_heads": 32}
    del hf["head_dim"]
    assert config_from_hf(hf).hd == 64


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"architectures": []}, "architectures"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"head_dim": 96}, "head_dim"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"num_attention_heads": 17 * 8}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": 16384}, "hidden_size"),
    ({"intermediate_size": 20000}, "intermediate_size"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
])
def test_unsupported_configs_are_refused_by_field(change, field):
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.")):
        config_from_hf({**LLAMA, **change})


def test_missing_field_and_bad_arguments():
    hf = dict(LLAMA)
    del hf["hidden_size"]
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        config_from_hf(hf)
    with pytest.raises(CheckpointError, match="weights"):
        config_from_hf(LLAMA, weights="int4")
    with pytest.raises(CheckpointError, match="llama3 lacks 'factor'"):
        config_from_hf({**LLAMA, "rope_scaling": {"rope_type": "llama3"}})


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        read_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_config(tmp_path)


def test_eos_ids(tmp_path):
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == {2}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128008, 128009]}')
    assert eos_token_ids(tmp_path, {"eos_token_id": 128001}) == {128001, 128008, 128009}
    assert eos_token_ids(tmp_path / "x", {}) == set()


def test_llama3_inv_freq_matches_transformers():
    """The host-side llama3 frequency table equals transformers' own (its rotary embedding buffer)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, num_hidden_layers=1,
                                  intermediate_size=64, vocab_size=32, max_position_embeddings=131072,
                                  rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                  low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    cfg = config_from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert cfg.rope_llama3 == (8.0, 1.0, 4.0, 8192.0)
    ours = rope_inv_freq(cfg)
    torch.testing.assert_close(ours.float(), rot.inv_freq.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(cfg.with_(rope_llama3=()))
    assert (ours < plain).any() and (ours == plain).any()       # long waves slowed, short ones kept
