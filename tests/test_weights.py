"""MLAWeights: HF names, per-head views, state-dict checks, safetensors checkpoint loading."""

import json

import pytest
import torch
from safetensors.torch import save_file

import mla
from mla import MLAConfig, MLAWeights


def test_names_and_view_shapes():
    cfg = MLAConfig.from_preset("tiny")
    w = MLAWeights(cfg)
    names = {n for n, _ in w.named_parameters()}
    assert names == {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                     "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                     "o_proj.weight"}
    h, d, r, v, c, q = 4, 16, 8, 16, 32, 24
    assert w.W_UQ.shape == (h, d, q) and w.W_QR.shape == (h, r, q)
    assert w.W_DKV.shape == (c, 64) and w.W_KR.shape == (r, 64)
    assert w.W_UK.shape == (h, d, c) and w.W_UV.shape == (h, v, c)
    assert w.W_O.shape == (64, h, v)
    # views, not copies: the tiers read the checkpoint's own memory
    assert w.W_UK.untyped_storage().data_ptr() == w.kv_b_proj.weight.untyped_storage().data_ptr()
    # head i of W_UK is rows [i(d+v), i(d+v)+d) of kv_b_proj
    assert torch.equal(w.W_UK[1], w.kv_b_proj.weight[32:48])
    assert torch.equal(w.W_UV[1], w.kv_b_proj.weight[48:64])
    lite = MLAWeights(MLAConfig.from_preset("tiny").replace(q_lora_rank=None))
    assert "q_proj.weight" in dict(lite.named_parameters()) and lite.W_UQ.shape == (h, d, 64)


def test_seeded_init_is_reproducible():
    cfg = MLAConfig.from_preset("tiny")
    a, b, c = MLAWeights(cfg, seed=3), MLAWeights(cfg, seed=3), MLAWeights(cfg, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.kv_b_proj.weight, c.kv_b_proj.weight)


def test_state_dict_errors_name_tensors_and_change_nothing():
    w = MLAWeights(MLAConfig.from_preset("tiny"))
    before = {k: t.clone() for k, t in w.state_dict().items()}
    sd = {k: torch.randn_like(t) for k, t in before.items()}
    sd.pop("kv_b_proj.weight")
    sd["kv_b_proj.weight_scale"] = torch.ones(1)
    sd["o_proj.weight"] = torch.randn(3, 3)
    with pytest.raises(ValueError) as err:
        w.load_state_dict(sd)
    msg = str(err.value)
    assert "missing ['kv_b_proj.weight']" in msg and "kv_b_proj.weight_scale" in msg
    assert "o_proj.weight: got (3, 3), expected (64, 64)" in msg
    assert all(torch.equal(before[k], t) for k, t in w.state_dict().items())


def _write_checkpoint(path, cfg, state, layer, shards):
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    full = {f"model.layers.{layer}.self_attn.{k}": v.contiguous() for k, v in state.items()}
    full["model.embed_tokens.weight"] = torch.randn(10, cfg.hidden_size)
    if shards == 1:
        save_file(full, str(path / "model.safetensors"))
        return
    keys = sorted(full)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: full[k] for k in keys[i::shards]}
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_from_pretrained_loads_one_layer(tmp_path, shards):
    cfg = MLAConfig.from_preset("tiny")
    src = MLAWeights(cfg, seed=5)
    _write_checkpoint(tmp_path, cfg, src.state_dict(), layer=2, shards=shards)
    got = MLAWeights.from_pretrained(tmp_path, layer=2)
    assert got.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 got.state_dict().values()))
    with pytest.raises(ValueError, match="model.layers.7.self_attn"):
        MLAWeights.from_pretrained(tmp_path, layer=7)


def test_from_pretrained_names_missing_and_misshaped(tmp_path):
    cfg = MLAConfig.from_preset("tiny")
    state = MLAWeights(cfg).state_dict()
    state.pop("q_a_layernorm.weight")
    state["kv_b_proj.weight"] = torch.randn(5, 5)
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    with pytest.raises(ValueError, match=r"missing \['q_a_layernorm.weight'\].*kv_b_proj.weight: got \(5, 5\)"):
        MLAWeights.from_pretrained(tmp_path)


def test_fp8_block_scales_are_dequantised(tmp_path):
    cfg = MLAConfig.from_preset("tiny")
    state = MLAWeights(cfg, seed=6).state_dict()
    w = state["kv_b_proj.weight"]  # (128, 32): one 128x128 block row, one column block
    scale = torch.tensor([[0.5]])
    state["kv_b_proj.weight"] = (w / 0.5).to(torch.float8_e4m3fn)
    state["kv_b_proj.weight_scale_inv"] = scale
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    got = MLAWeights.from_pretrained(tmp_path, dtype=torch.float32)
    expect = (w / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.allclose(got.kv_b_proj.weight, expect.to(torch.bfloat16).float())


def test_hf_attention_state_dict_loads_unchanged():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    cfg = MLAConfig.from_preset("tiny")
    fields = cfg.to_hf_dict()
    fields.update(vocab_size=8, num_hidden_layers=1, num_key_value_heads=cfg.num_heads)
    hf = DeepseekV3Attention(transformers.DeepseekV3Config(**fields), layer_idx=0)
    w = MLAWeights(cfg)
    w.load_state_dict(hf.state_dict())
    assert torch.equal(w.kv_b_proj.weight, hf.kv_b_proj.weight)
    assert mla.build(w, "naive").weights is w
