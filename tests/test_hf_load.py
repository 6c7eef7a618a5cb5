"""Reading checkpoint folders: sharded and single-file checkpoints give the same weights, the folder is
never written, and malformed folders are refused with the file and tensor named (before any device
allocation for everything the headers reveal). Nothing is compiled here (compile=False)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_checkpoints import make_checkpoint  # noqa: E402

from megart.models import CheckpointError, from_pretrained  # noqa: E402
from megart.models.hf_config import config_from_hf, read_config  # noqa: E402
from megart.models.hf_load import Checkpoint, expected_tensors  # noqa: E402

KW = dict(device="cpu", max_seq=64, nw=8, compile=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("llama_g3")
    make_checkpoint(f, "llama_g3", seed=1, dtype=torch.bfloat16, tokenizer=False)
    return f


def _copy(folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_single_file_and_shards_load_the_same_weights(folder, tmp_path):
    import transformers
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).save_pretrained(
        str(sharded), max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    before = _snapshot(folder)
    a, b = from_pretrained(folder, **KW), from_pretrained(sharded, **KW)
    assert _snapshot(folder) == before                   # nothing written into the model folder
    assert not a.cfg.tied and a.weights.head is not a.weights.embed
    for La, Lb in zip(a.weights.layers, b.weights.layers):
        assert La.keys() == Lb.keys() and all(torch.equal(La[k], Lb[k]) for k in La)
    assert torch.equal(a.weights.head, b.weights.head) and torch.equal(a.weights.embed, b.weights.embed)
    # the fused projection holds q, k, v in that order
    with Checkpoint(folder) as ck:
        q = ck.get("model.layers.1.self_attn.q_proj.weight")
        v = ck.get("model.layers.1.self_attn.v_proj.weight")
    assert torch.equal(a.weights.layers[1]["wqkv"][:q.shape[0]], q)
    assert torch.equal(a.weights.layers[1]["wqkv"][-v.shape[0]:], v)
    # a truncated shard is named, and the process goes on loading
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: not a readable safetensors file"):
        from_pretrained(sharded, **KW)
    assert from_pretrained(folder, **KW).cfg.group == 3


def test_expected_tensors_cover_the_checkpoint(folder):
    cfg = config_from_hf(read_config(folder))
    with Checkpoint(folder) as ck:
        assert set(ck.names()) == set(expected_tensors(cfg))


def test_missing_config_and_weights(tmp_path, folder):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        from_pretrained(tmp_path, **KW)
    d = _copy(folder, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        from_pretrained(d, **KW)


def _rewrite(folder, tmp_path, edit):
    d = _copy(folder, tmp_path)
    tensors = safetensors_torch.load_file(str(d / "model.safetensors"))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    return d


def test_wrong_shape_missing_tensor_and_bias(folder, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    d = _rewrite(folder, tmp_path / "a", lambda t: t.__setitem__(name, t[name][:-8].clone()))
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{name}' has shape \[248, 192\], "
                                              r"the config implies \[256, 192\]"):
        from_pretrained(d, **KW)
    d = _rewrite(folder, tmp_path / "b", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' is missing"):
        from_pretrained(d, **KW)
    d = _rewrite(folder, tmp_path / "c", lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias",
                                                                  torch.zeros(768, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match="q_proj.bias' is a bias"):
        from_pretrained(d, **KW)
    d = _rewrite(folder, tmp_path / "d", lambda t: t.__setitem__("model.norm.weight",
                                                                  t["model.norm.weight"].to(torch.int16)))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is I16"):
        from_pretrained(d, **KW)
    assert from_pretrained(folder, **KW).cfg.group == 3      # the process is still usable


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001])
def test_truncated_safetensors(folder, tmp_path, keep):
    d = _copy(folder, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        from_pretrained(d, **KW)
    m = from_pretrained(folder, **KW)                       # the process is still usable
    assert m.cfg.group == 3


def test_index_naming_a_missing_shard(folder, tmp_path):
    d = _copy(folder, tmp_path)
    names = list(safetensors_torch.load_file(str(d / "model.safetensors")))
    wm = {n: "model.safetensors" for n in names}
    wm["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is in shard 'model-00002-of-00002.safetensors', "
                                              "which is missing"):
        from_pretrained(d, **KW)


def test_unsupported_config_refused_before_reading_weights(folder, tmp_path):
    d = _copy(folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "dynamic"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()                    # never reached
    with pytest.raises(CheckpointError, match="rope_parameters.rope_type = 'dynamic'"):
        from_pretrained(d, **KW)
