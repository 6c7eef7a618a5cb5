"""Weights of a Hugging Face Llama / Qwen3 folder (safetensors) -> LlamaWeights on the target device.

Every tensor is checked against the config from the files' headers alone (names, shapes, dtypes) before
anything is allocated; then each is read on its own onto the device and converted there. safetensors
opens and validates every file; the bytes are read with plain file reads through a bounded host buffer
(megart.models.safetensors_read says why not through safetensors' memory map), so host memory holds no
copy of the model, nor of any whole tensor, on the way to the GPU. The folder is only read.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from .hf_config import CheckpointError
from .llama_config import FP8_LINEARS, LlamaConfig, LlamaWeights, quantize_fp8
from .safetensors_read import DTYPES, TensorReader, read_header

__all__ = ["Checkpoint", "StateDict", "check_tensors", "expected_tensors", "load_weights"]

READABLE = set(DTYPES)          # safetensors dtype names megart converts to bf16 on load
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def expected_tensors(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor megart reads."""
    d, qd, kvd = cfg.d, cfg.n_q * cfg.hd, cfg.n_kv * cfg.hd
    out = {"model.embed_tokens.weight": (cfg.vocab, d), "model.norm.weight": (d,)}
    if cfg.head_separate:
        out["lm_head.weight"] = (cfg.vocab, d)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (qd, d), p + "self_attn.k_proj.weight": (kvd, d),
                    p + "self_attn.v_proj.weight": (kvd, d), p + "self_attn.o_proj.weight": (d, qd),
                    p + "mlp.gate_proj.weight": (cfg.ffn, d), p + "mlp.up_proj.weight": (cfg.ffn, d),
                    p + "mlp.down_proj.weight": (d, cfg.ffn)})
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (cfg.hd,)
            out[p + "self_attn.k_norm.weight"] = (cfg.hd,)
    return out


class Checkpoint:
    """The safetensors files of one folder, opened for reading (use as a context manager), and which file
    holds each tensor: model.safetensors, or the shards listed by model.safetensors.index.json."""

    def __init__(self, folder, device="cpu", reader: TensorReader | None = None):
        self.folder = Path(folder)
        self.device = str(device)
        self.reader = reader if reader is not None else TensorReader(device)
        self._stack = ExitStack()
        self._files: dict[str, object] = {}      # file name -> open binary file (plain reads)
        self._entries: dict[str, dict] = {}      # file name -> {tensor name: Entry}
        self.where: dict[str, str] = {}          # tensor name -> file name
        index, single = self.folder / INDEX, self.folder / SINGLE
        try:
            if index.is_file():
                self._read_index(index)
            elif single.is_file():
                for name in self._open(SINGLE):
                    self.where[name] = SINGLE
            else:
                raise CheckpointError(f"{self.folder}: neither {SINGLE} nor {INDEX} (megart reads safetensors "
                                      "checkpoints only)")
        except BaseException:
            self.close()
            raise

    def _read_index(self, index: Path) -> None:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
        for name, file in weight_map.items():
            if not (self.folder / file).is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is in shard {file!r}, which is missing")
            self.where[name] = file
        for file in sorted(set(weight_map.values())):
            listed = {n for n, f in weight_map.items() if f == file}
            missing = listed - set(self._open(file))
            if missing:
                raise CheckpointError(f"{self.folder / file}: lacks {sorted(missing)[0]!r}, which {INDEX} "
                                      "places there")

    def _open(self, file: str) -> dict:
        """{tensor name: Entry} of one file, opened once: safetensors validates it (header, sizes), then a
        plain binary handle stays open for the reads."""
        if file not in self._files:
            from safetensors import safe_open
            path = self.folder / file
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    names = set(f.keys())
            except Exception as e:   # safetensors raises its own error types (truncated header, bad JSON)
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            entries = read_header(path)
            if set(entries) != names:
                raise CheckpointError(f"{path}: header names disagree with safetensors' reading of it")
            self._entries[file] = entries
            self._files[file] = self._stack.enter_context(open(path, "rb", buffering=0))
        return self._entries[file]

    def close(self) -> None:
        self.reader.close()
        self._stack.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _file_of(self, name: str) -> str:
        if name not in self.where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        return self.where[name]

    def names(self):
        return self.where.keys()

    def locate(self, name: str) -> str:
        """Where a tensor lives, for error messages."""
        return str(self.folder / self._file_of(name))

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype name) from the file header."""
        e = self._open(self._file_of(name))[name]
        return e.shape, e.dtype

    def check(self, cfg: LlamaConfig) -> None:
        check_tensors(cfg, self)

    def get(self, name: str) -> torch.Tensor:
        """One tensor on the device, bf16 (converted there; host memory holds at most the reader's buffers)."""
        file = self._file_of(name)
        entry = self._open(file)[name]
        return self.reader.read(self._files[file], self.folder / file, name, entry)


class StateDict:
    """An in-memory {name: tensor} (e.g. a transformers model's state_dict()) with Checkpoint's reading
    interface: the GPU tests build real-size models without writing them to disk."""
    DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

    def __init__(self, tensors: dict, device="cpu"):
        self.tensors, self.device = tensors, torch.device(device)

    def names(self):
        return self.tensors.keys()

    def locate(self, name: str) -> str:
        return "<state dict>"

    def meta(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"<state dict>: tensor {name!r} is missing")
        t = self.tensors[name]
        return tuple(t.shape), self.DTYPES.get(t.dtype, str(t.dtype))

    def check(self, cfg: LlamaConfig) -> None:
        check_tensors(cfg, self)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.device, torch.bfloat16)


def check_tensors(cfg: LlamaConfig, src) -> None:
    """Names, shapes and dtypes against the config, from metadata only (nothing is allocated)."""
    for name in src.names():
        if name.endswith(".bias"):
            raise CheckpointError(f"{src.locate(name)}: tensor {name!r} is a bias; megart's Llama / Qwen3 layers "
                                  "have none")
    for name, shape in expected_tensors(cfg).items():
        got, dtype = src.meta(name)
        if got != shape:
            raise CheckpointError(f"{src.locate(name)}: tensor {name!r} has shape {list(got)}, the config implies "
                                  f"{list(shape)}")
        if dtype not in READABLE:
            raise CheckpointError(f"{src.locate(name)}: tensor {name!r} is {dtype}; megart reads "
                                  f"{', '.join(sorted(READABLE))}")


def load_weights(cfg: LlamaConfig, ckpt, device) -> LlamaWeights:
    """LlamaWeights in megart's layout (fused [q; k; v] rows, fp8: e4m3 o/gate/up/down + per-row scales,
    gate|up stacked), read tensor by tensor from a Checkpoint or StateDict. Call ckpt.check(cfg) first."""
    device = torch.device(device)
    fp8 = cfg.wdtype == "fp8"
    W = LlamaWeights(cfg)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        L = {"in_norm": ckpt.get(p + "input_layernorm.weight"), "post_norm": ckpt.get(p + "post_attention_layernorm.weight")}
        wqkv = torch.empty(cfg.qkv_rows, cfg.d, dtype=torch.bfloat16, device=device)
        row = 0
        for part in ("q", "k", "v"):
            t = ckpt.get(p + f"self_attn.{part}_proj.weight")
            wqkv[row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
            del t
        L["wqkv"] = wqkv
        if fp8 and cfg.fp8_qkv:     # (qkv_rope_append_fp8: e4m3 rows + per-row scales, as make_weights)
            L["wqkv"], L["swqkv"] = quantize_fp8(wqkv)
        if cfg.qk_norm:
            L["q_norm"], L["k_norm"] = ckpt.get(p + "self_attn.q_norm.weight"), ckpt.get(p + "self_attn.k_norm.weight")
        for key, name in (("wo", "self_attn.o_proj"), ("wg", "mlp.gate_proj"), ("wu", "mlp.up_proj"),
                          ("wd", "mlp.down_proj")):
            t = ckpt.get(p + name + ".weight")
            if fp8 and key in FP8_LINEARS:
                L[key], L["s" + key] = quantize_fp8(t)
                del t
            else:
                L[key] = t
        if fp8:      # gate and up as one [2 ffn, d] e4m3 matrix (one GEMV call streams both), as make_weights
            L["wgu"], L["swgu"] = torch.cat([L["wg"], L["wu"]]), torch.cat([L["swg"], L["swu"]])
            L["wg"], L["wu"] = L["wgu"][:cfg.ffn], L["wgu"][cfg.ffn:]
            L["swg"], L["swu"] = L["swgu"][:cfg.ffn], L["swgu"][cfg.ffn:]
        W.layers.append(L)
    W.final_norm = ckpt.get("model.norm.weight")
    W.embed = ckpt.get("model.embed_tokens.weight")
    W.head = ckpt.get("lm_head.weight") if cfg.head_separate else W.embed
    return W
