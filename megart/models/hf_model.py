"""A Hugging Face checkpoint folder as a megakernel model: `from_pretrained(path)` -> CheckpointModel.

    from megart.models import from_pretrained
    m = from_pretrained("/models/Llama-3.2-1B-Instruct", max_seq=4096)      # bf16; weights="fp8" quantises
    print(m.generate_text("The capital of France is", max_new_tokens=32))
    logits = m.prefill(ids)             # fills the KV cache, returns the last position's f32 logits
    logits, token = m.step()            # greedy decode continues from the prefill, one launch per token

CheckpointModel is a LlamaModel (same step / generate / reset) whose weights come from the folder and
whose KV cache starts empty (cfg.prefill = 0): a prompt goes in through prefill(), which runs as batched
torch on the same weights (megart/models/prefill.py) and leaves the device state at the next position
with the argmax token as input. On a CPU the decode steps run in megart's emulator, as for LlamaModel.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .hf_config import config_from_hf, eos_token_ids, read_config
from .hf_load import Checkpoint, StateDict, load_weights
from .llama import LlamaModel
from .llama_config import LlamaConfig, LlamaWeights, make_kv_cache
from .prefill import prefill_logits

__all__ = ["CheckpointModel", "GenerationStats", "from_pretrained", "from_state_dict"]


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float               # prompt in -> first new token known on the host (prefill + its argmax)
    decode_s: float             # the decode steps after the first token
    stopped: str                # "eos" | "max_new_tokens" | "max_seq"

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: tokens after the first one, per second of decoding."""
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


class CheckpointModel(LlamaModel):
    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, *, folder=None, eos_ids=(), device=None,
                 nw: int | None = None, **kw):
        device = torch.device(device if device is not None else weights.embed.device)
        kv = make_kv_cache(cfg, device=device)          # prefill = 0: all rows zero
        super().__init__(cfg, weights, kv, device=device, nw=nw, **kw)
        self.folder = None if folder is None else Path(folder)
        self.eos_ids = set(eos_ids)
        self._tokenizer = None
        self.last_stats: GenerationStats | None = None
        self.last_ids: list[int] = []           # the tokens the last generate_ids / generate_text produced

    # --- input checks (raised before any state changes, so the model stays usable) ---------------------
    def _token_ids(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids).reshape(-1)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        if ids.numel() == 0:
            raise ValueError("the prompt is empty: prefill needs at least one token")
        bad = ((ids < 0) | (ids >= self.cfg.vocab)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {self.cfg.vocab})")
        if ids.numel() >= self.cfg.max_seq:
            raise ValueError(f"the prompt has {ids.numel()} tokens; max_seq={self.cfg.max_seq} leaves room for at "
                             f"most {self.cfg.max_seq - 1} (one cache row is needed per decoded token)")
        return ids.to(self.device, torch.long)

    # step(): LlamaModel.step refuses a token outside the vocabulary (InputError, a ValueError)

    # --- prompt in ------------------------------------------------------------------------------------
    def prefill(self, token_ids) -> torch.Tensor:
        """Fill cache rows [0, n) with the prompt's K/V and return the last position's f32 logits [vocab].
        The device state is left at pos = n with the argmax as the next input, so step() / generate(k)
        continue greedily."""
        ids = self._token_ids(token_ids)
        logits = prefill_logits(self.cfg, self.weights, self.kv, self.cos, self.sin, ids, 0)
        self.reset(pos=ids.numel(), token=int(torch.argmax(logits)))
        return logits

    # --- text -----------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.folder is None:
                raise ValueError("this model was not loaded from a folder, so it has no tokenizer")
            from .hf_tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.folder)
        return self._tokenizer

    def generate_ids(self, token_ids, max_new_tokens: int, on_token=None) -> list[int]:
        """Greedy: prefill the prompt, then one decode step per token until EOS, max_new_tokens or a full
        cache. on_token(id) is called as each token is known (streaming). EOS is not returned. Timing in
        self.last_stats."""
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        t0 = time.perf_counter()
        logits = self.prefill(token_ids)
        n = self.next_pos
        tok = int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
        out, stopped = [], "max_new_tokens"
        t1 = time.perf_counter()
        while True:
            if tok in self.eos_ids:
                stopped = "eos"
                break
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if len(out) >= max_new_tokens:
                break
            if self.next_pos >= self.cfg.max_seq:
                stopped = "max_seq"
                break
            _, t = super().step()        # the device already holds the input token and the position
            tok = int(t.reshape(-1)[0])
        self.last_ids = out
        self.last_stats = GenerationStats(prompt_tokens=n, new_tokens=len(out), ttft_s=ttft,
                                          decode_s=time.perf_counter() - t1, stopped=stopped)
        return out

    def generate_text(self, prompt: str, max_new_tokens: int, on_text=None) -> str:
        """The checkpoint's tokenizer on `prompt`, greedy decoding, the new text (on_text(piece) streams it)."""
        tk = self.tokenizer
        ids, shown = [], ""

        def emit(tok):
            nonlocal shown
            ids.append(tok)
            text = tk.decode(ids)
            if on_text is not None and len(text) > len(shown) and text.startswith(shown):
                on_text(text[len(shown):])         # only whole characters (a partial UTF-8 byte waits)
                shown = text

        self.generate_ids(tk.encode(prompt), max_new_tokens, on_token=emit)
        return tk.decode(ids)


def from_pretrained(path, *, device=None, max_seq: int = 4096, weights: str = "bf16", nw: int | None = None,
                    **model_kw) -> CheckpointModel:
    """Load a local Hugging Face folder (config.json + model.safetensors or an index of shards) of a
    LlamaForCausalLM or Qwen3ForCausalLM. Unsupported configs and malformed files are refused (CheckpointError
    naming the field, file or tensor) before the device memory is allocated; tensors are read one at a time
    straight to `device` (default: CUDA when available). weights="fp8" quantises o/gate/up/down to e4m3 on
    load. The folder is only read."""
    hf = read_config(path)
    cfg = config_from_hf(hf, max_seq=max_seq, weights=weights, name=Path(path).name)
    device = _device(device)
    with Checkpoint(path, device) as ck:
        ck.check(cfg)
        W = load_weights(cfg, ck, device)
    return CheckpointModel(cfg, W, folder=path, eos_ids=eos_token_ids(path, hf), device=device, nw=nw, **model_kw)


def from_state_dict(hf: dict, tensors: dict, *, device=None, max_seq: int = 4096, weights: str = "bf16",
                    nw: int | None = None, **model_kw) -> CheckpointModel:
    """from_pretrained for a parsed config.json and an in-memory {name: tensor} with the checkpoint's names
    (e.g. a transformers model's state_dict()); no folder, so no tokenizer and no EOS."""
    cfg = config_from_hf(hf, max_seq=max_seq, weights=weights, name="state_dict")
    device = _device(device)
    src = StateDict(tensors, device)
    src.check(cfg)
    return CheckpointModel(cfg, load_weights(cfg, src, device), device=device, nw=nw, **model_kw)


def _device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
