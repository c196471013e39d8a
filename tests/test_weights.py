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
    assert w.W_Q.shape == (h, d + r, q) and torch.equal(w.W_Q, torch.cat([w.W_UQ, w.W_QR], 1))
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


def _states_equal(module, before):
    return all(torch.equal(before[k], t) for k, t in module.state_dict().items())


def test_non_strict_load_checks_every_shape_before_copying():
    w = MLAWeights(MLAConfig.from_preset("tiny"))
    before = {k: t.clone() for k, t in w.state_dict().items()}
    sd = {k: torch.randn_like(t) for k, t in before.items()}
    last = sorted(sd)[-1]
    sd[last] = torch.randn(3, 3)  # the others would be copied first by nn.Module's loader
    with pytest.raises(ValueError, match=rf"{last}: got \(3, 3\)"):
        w.load_state_dict(sd, strict=False)
    assert _states_equal(w, before)
    sd.pop(last)  # a missing name is fine when not strict; the rest loads
    w.load_state_dict(sd, strict=False)
    assert torch.equal(w.kv_b_proj.weight, sd["kv_b_proj.weight"])


def test_load_refuses_fp8_and_non_float_tensors():
    w = MLAWeights(MLAConfig.from_preset("tiny"))
    before = {k: t.clone() for k, t in w.state_dict().items()}
    for bad, match in [(torch.float8_e4m3fn, "kv_b_proj.weight: float8_e4m3fn"),
                       (torch.int64, "kv_b_proj.weight: int64")]:
        sd = dict(before, **{"kv_b_proj.weight": before["kv_b_proj.weight"].to(bad)})
        for strict in (True, False):
            with pytest.raises(ValueError, match=match):
                w.load_state_dict(sd, strict=strict)
    assert _states_equal(w, before)


def test_rotary_inv_freq_is_ignored(tmp_path):
    cfg = MLAConfig.from_preset("tiny")
    src = MLAWeights(cfg, seed=2)
    state = dict(src.state_dict(), **{"rotary_emb.inv_freq": torch.ones(cfg.qk_rope_head_dim // 2)})
    w = MLAWeights(cfg)
    w.load_state_dict(state)
    assert torch.equal(w.kv_b_proj.weight, src.kv_b_proj.weight)
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    got = MLAWeights.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 got.state_dict().values()))


def _fp8_state(cfg, block=128, seed=6):
    """A release-like state dict: kv_b_proj e4m3 with one distinct scale a block, the rest bf16."""
    state = {k: t.to(torch.bfloat16) for k, t in MLAWeights(cfg, seed=seed).state_dict().items()}
    w = state["kv_b_proj.weight"]
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.arange(1, grid[0] * grid[1] + 1, dtype=torch.float32).view(grid) / 8
    state["kv_b_proj.weight"] = (w.float() * 50).to(torch.float8_e4m3fn)
    state["kv_b_proj.weight_scale_inv"] = scale
    return state


def test_fp8_scales_map_to_their_blocks_over_a_multi_block_grid(tmp_path):
    # kv_b_proj is (10·(16+16), 200) = (320, 200): a 3 x 2 grid of 128 x 128 blocks whose last
    # row and column of blocks are partial (64 rows, 72 columns).
    cfg = MLAConfig.from_preset("tiny").replace(num_heads=10, kv_lora_rank=200)
    state = _fp8_state(cfg)
    w8, scale = state["kv_b_proj.weight"], state["kv_b_proj.weight_scale_inv"]
    assert w8.shape == (320, 200) and scale.shape == (3, 2)
    expect = torch.empty(w8.shape)
    for i in range(3):
        for j in range(2):
            tile = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            expect[tile] = w8[tile].float() * scale[i, j]
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    got = MLAWeights.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(got.kv_b_proj.weight, expect)
    # fp8 projections count as bfloat16 for the default dtype, as the release's others are
    assert MLAWeights.from_pretrained(tmp_path).dtype == torch.bfloat16


def _scale_missing(state):
    state.pop("kv_b_proj.weight_scale_inv")


def _scale_transposed(state):
    state["kv_b_proj.weight_scale_inv"] = state["kv_b_proj.weight_scale_inv"].T.contiguous()


def _scale_on_bf16(state):
    state["o_proj.weight_scale_inv"] = torch.ones(1, 1)


def _scale_not_finite(state):
    state["kv_b_proj.weight_scale_inv"][0, 0] = float("nan")


@pytest.mark.parametrize("spoil,match", [
    (_scale_missing, r"kv_b_proj.weight is float8_e4m3fn but has no .*kv_b_proj.weight_scale_inv"),
    (_scale_transposed, r"kv_b_proj.weight_scale_inv has shape \(2, 3\).*\(3, 2\)"),
    (_scale_on_bf16, r"o_proj.weight_scale_inv .*o_proj.weight, which is bfloat16"),
    (_scale_not_finite, r"kv_b_proj.weight_scale_inv .*finite"),
])
def test_fp8_bad_scales_are_refused_naming_the_tensor(tmp_path, spoil, match):
    cfg = MLAConfig.from_preset("tiny").replace(num_heads=10, kv_lora_rank=200)
    state = _fp8_state(cfg)
    spoil(state)
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    with pytest.raises(ValueError, match="model.layers.0.self_attn." + match):
        MLAWeights.from_pretrained(tmp_path)


def test_default_dtype_is_the_projections_and_mixed_ones_are_refused(tmp_path):
    cfg = MLAConfig.from_preset("tiny")
    state = {k: t if "layernorm" in k else t.to(torch.bfloat16)
             for k, t in MLAWeights(cfg).state_dict().items()}
    # kv_a_layernorm.weight, float32, sorts (and is stored) before every projection
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    assert MLAWeights.from_pretrained(tmp_path).dtype == torch.bfloat16
    state["o_proj.weight"] = state["o_proj.weight"].half()
    _write_checkpoint(tmp_path, cfg, state, layer=0, shards=1)
    with pytest.raises(ValueError, match=r"mix dtypes.*o_proj.weight.*float16.*pass dtype="):
        MLAWeights.from_pretrained(tmp_path)
    assert MLAWeights.from_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("shards", [1, 3])
def test_truncated_safetensors_is_named(tmp_path, shards):
    cfg = MLAConfig.from_preset("tiny")
    _write_checkpoint(tmp_path, cfg, MLAWeights(cfg).state_dict(), layer=0, shards=shards)
    name = "model.safetensors" if shards == 1 else "model-00002-of-00003.safetensors"
    _truncate(tmp_path / name)
    with pytest.raises(ValueError, match=rf"{name}: not a readable safetensors file"):
        MLAWeights.from_pretrained(tmp_path)


@pytest.mark.parametrize("file,text,match", [
    ("config.json", '{"hidden_size": 64,', r"config.json: not valid JSON"),
    ("config.json", '[1, 2]', r"config.json: expected a JSON object"),
    ("config.json", '{"hidden_size": 64}', r"config.json: .*num_heads"),
    ("model.safetensors.index.json", '{"weight_map": ', r"index.json: not valid JSON"),
    ("model.safetensors.index.json", '{"metadata": {}}', r"index.json: expected .*weight_map"),
    ("model.safetensors.index.json", '{"weight_map": {"model.layers.0.self_attn.o_proj.weight": '
     '"missing.safetensors"}}', r"missing.safetensors.*not found.*index.json"),
    ("model.safetensors.index.json", '{"weight_map": {"model.layers.0.self_attn.o_proj.weight": '
     '"model-00001-of-00003.safetensors"}}', r"00001-of-00003.safetensors: holds no tensor .*o_proj"),
])
def test_malformed_json_files_are_named(tmp_path, file, text, match):
    cfg = MLAConfig.from_preset("tiny")
    _write_checkpoint(tmp_path, cfg, MLAWeights(cfg).state_dict(), layer=0, shards=3)
    (tmp_path / file).write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        MLAWeights.from_pretrained(tmp_path)
