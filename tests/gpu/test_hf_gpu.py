"""Hugging Face model shapes on the GPU with random weights: megart against transformers, the reference
users trust (the CPU twin is tests/test_hf_model.py at tiny sizes).

* Llama-3.2-1B, Llama-3.2-3B (GQA group 3), Llama-3.1-8B (untied head), Qwen3-0.6B and Qwen3-8B (q/k
  norm): a 64-token prefill and 32 teacher-forced decode steps; the stacked logits' relative error against
  transformers fp32 must be within 1.5x of transformers bf16's own.
* the 1B shape through a real folder (save_pretrained, from_pretrained): host memory during the load stays
  under 1.2x the checkpoint file, prefill = decode to the decode tolerance, a 2k-token prompt's
  time-to-first-token <= 50 ms, and text out with a tokenizer from the folder.

Run: PYTHONPATH=. MEGART_REQUIRE_GPU=1 python -m pytest -q tests/gpu/test_hf_gpu.py -rA
"""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

LLAMA3 = lambda factor: dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,  # noqa: E731
                             original_max_position_embeddings=8192)
SHAPES = {
    "llama3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                  num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                                  rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3(32.0))),
    "llama3.2-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                                  num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                                  rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3(32.0))),
    "llama3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                                  rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3(8.0))),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1000000.0, max_position_embeddings=40960)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                               rope_theta=1000000.0, max_position_embeddings=40960)),
}
PROMPT, STEPS, RATIO, DECODE_TOL = 64, 32, 1.5, 3e-2
TTFT_PROMPT, TTFT_MS = 2048, 50.0


def _hf_dict(cfg) -> dict:
    d = cfg.to_dict()
    d["architectures"] = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]]
    return d


@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_teacher_forced_logits_match_transformers(shape, cuda):
    from hf_checkpoints import hf_config, hf_model
    from megart.models import from_state_dict
    from megart.models.llama_config import relerr
    arch, kw = SHAPES[shape]
    cfg = hf_config(arch, **kw)
    torch.cuda.empty_cache()
    hf = hf_model(cfg, seed=0, dtype=torch.float32, device="cuda")
    ids = torch.randint(3, cfg.vocab_size, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(1)).cuda()
    want = hf(ids[None]).logits[0].float()
    hf.to(torch.bfloat16)                                   # in place: the bf16 run and megart's weights
    bf16 = hf(ids[None]).logits[0].float()
    m = from_state_dict(_hf_dict(cfg), hf.state_dict(), device="cuda", max_seq=512)
    got = [m.prefill(ids[:PROMPT])]
    for s in range(PROMPT, PROMPT + STEPS - 1):
        logits, _ = m.step(ids[s:s + 1], pos=s)
        got.append(logits.clone())
    got = torch.stack(got)
    span = slice(PROMPT - 1, PROMPT + STEPS - 1)
    ours, theirs = relerr(got, want[span]), relerr(bf16[span], want[span])
    print(f"[hf-gpu] {shape}: megart {ours:.3e}, transformers bf16 {theirs:.3e} (vs transformers fp32); "
          f"{m.describe()}")
    assert ours <= RATIO * theirs, (shape, ours, theirs)
    del m, hf
    gc.collect()
    torch.cuda.empty_cache()


class _PeakRSS:
    """Peak resident set size growth (bytes) of this process while the block runs, polled every 5 ms."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


@torch.no_grad()
def test_1b_folder_memory_prefill_ttft_and_text(tmp_path, cuda):
    from hf_checkpoints import hf_config, hf_model, save_tokenizer
    from megart.models import from_pretrained
    from megart.models.hf_config import config_from_hf, read_config
    from megart.models.hf_load import Checkpoint, load_weights
    from megart.models.llama_config import relerr
    arch, kw = SHAPES["llama3.2-1b"]
    cfg = hf_config(arch, **kw)
    folder = tmp_path / "llama1b"
    hf = hf_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    hf.save_pretrained(str(folder))
    save_tokenizer(folder)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    largest = max(p.stat().st_size for p in folder.glob("*.safetensors"))
    # the weight-reading part of from_pretrained, measured alone (the graph build that follows allocates
    # host memory of its own, unrelated to the checkpoint's size)
    hf_cfg = config_from_hf(read_config(folder), max_seq=4096)
    with _PeakRSS() as rss:
        with Checkpoint(folder, "cuda:0") as ck:
            ck.check(hf_cfg)
            W = load_weights(hf_cfg, ck, "cuda:0")
    print(f"[hf-gpu] 1b load: host RSS grew {rss.growth / 1e9:.2f} GB, largest shard {largest / 1e9:.2f} GB")
    assert rss.growth <= 1.2 * largest
    del W
    torch.cuda.empty_cache()
    m = from_pretrained(folder, max_seq=4096)
    ids = torch.randint(3, cfg.vocab_size, (TTFT_PROMPT,), generator=torch.Generator().manual_seed(2)).cuda()
    # prefill == decode on a short prompt
    lp = m.prefill(ids[:40]).clone()
    m.reset(pos=0, clear_kv=True)
    for s in range(40):
        ld, _ = m.step(ids[s:s + 1], pos=s)
    assert relerr(lp, ld) < DECODE_TOL
    # time to first token at 2k (warm: the second of two runs)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tok = int(torch.argmax(m.prefill(ids)))
        ttft = (time.perf_counter() - t0) * 1e3
    print(f"[hf-gpu] 1b prefill of {TTFT_PROMPT} tokens: TTFT {ttft:.1f} ms")
    assert 0 <= tok < cfg.vocab_size and ttft <= TTFT_MS
    text = m.generate_text("w1 w2 w3 w4", 32)
    st = m.last_stats
    print(f"[hf-gpu] 1b text: {st.new_tokens} tokens, {st.tokens_per_s:.0f} tok/s, TTFT {st.ttft_s * 1e3:.1f} ms")
    assert isinstance(text, str) and st.new_tokens >= 1
