"""Random-init Hugging Face checkpoints for the tests, written by transformers' own save_pretrained (nothing
is downloaded), with a small word-level tokenizer so text in / text out works offline.

Weights are re-drawn as randn(out, in) / sqrt(in) and norm gains 1 + 0.1 randn (transformers' default init,
std 0.02, gives nearly uniform logits, where greedy decoding is decided by rounding noise), so logits are
peaked and a greedy sequence is a meaningful comparison."""
from __future__ import annotations

import math

import torch

VOCAB = 512
WORDS = 400           # the tokenizer's words; ids above stay valid model inputs

# (architecture, config kwargs): the equivalence configs the issue requires, at CPU-emulator size
CONFIGS = {
    # group 3, head_dim 128, untied head, llama3 RoPE scaling
    "llama_g3": ("llama", dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
                               max_position_embeddings=8192, rope_theta=500000.0,
                               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=64))),
    # group 7, head_dim 64, tied head
    "llama_g7": ("llama", dict(hidden_size=448, intermediate_size=512, num_hidden_layers=2, num_attention_heads=7,
                               num_key_value_heads=1, head_dim=64, tie_word_embeddings=True, rope_theta=10000.0)),
    # Qwen3: per-head q/k norm, group 2, head_dim 128, untied
    "qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, rope_theta=1000000.0)),
}


def hf_config(arch: str, **kw):
    import transformers
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    return cls(vocab_size=kw.pop("vocab_size", VOCAB), bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, **kw)


def hf_model(config, seed: int = 0, dtype=torch.float32, device="cpu"):
    """A transformers model of `config` with megart's test initialisation (see the module docstring)."""
    import transformers
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[config.model_type]
    with torch.device(device):
        m = cls(config).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(m.named_parameters()):
            r = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            p.copy_(r / math.sqrt(p.shape[1]) if p.dim() == 2 else 1 + 0.1 * r)
    m.tie_weights()
    return m.eval()


def save_tokenizer(folder) -> None:
    """A word-level tokenizer ("w0".."w399", <unk> <s> </s> at 0, 1, 2), saved the way transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def make_checkpoint(folder, name: str, seed: int = 0, dtype=torch.float32, tokenizer: bool = True, **save_kw):
    """Write CONFIGS[name] as a random-init checkpoint folder; returns the transformers config."""
    arch, kw = CONFIGS[name]
    cfg = hf_config(arch, **kw)
    hf_model(cfg, seed).to(dtype).save_pretrained(str(folder), **save_kw)
    if tokenizer:
        save_tokenizer(folder)
    return cfg
