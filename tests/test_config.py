"""MLAConfig: presets against the published checkpoints' config.json, HF parsing, validation."""

import pytest

import mla
from mla import MLAConfig

# Written out from each checkpoint's config.json on the HF hub (deepseek-ai/DeepSeek-V2,
# deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3), not taken from mla's own presets.
PUBLISHED = {
    "deepseek-v2": dict(hidden_size=5120, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, rope_theta=10000, max_position_embeddings=163840,
                        rms_norm_eps=1e-6,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=0.707,
                                          mscale_all_dim=0.707)),
    "deepseek-v2-lite": dict(hidden_size=2048, num_attention_heads=16, q_lora_rank=None,
                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, rope_theta=10000, max_position_embeddings=163840,
                             rms_norm_eps=1e-6,
                             rope_scaling=dict(type="yarn", factor=40,
                                               original_max_position_embeddings=4096, beta_fast=32,
                                               beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, rope_theta=10000, max_position_embeddings=163840,
                        rms_norm_eps=1e-6,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=1.0,
                                          mscale_all_dim=1.0)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_configs(name):
    assert MLAConfig.from_preset(name) == MLAConfig.from_hf(PUBLISHED[name])
    cfg = MLAConfig.from_preset(name)
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192


def test_from_hf_reads_transformers_objects_of_both_styles():
    transformers = pytest.importorskip("transformers")
    fields = dict(PUBLISHED["deepseek-v3"])
    fields.pop("num_attention_heads")
    hf = transformers.DeepseekV3Config(num_attention_heads=128, **fields)
    assert MLAConfig.from_hf(hf) == MLAConfig.from_preset("deepseek-v3")
    # transformers 5.x spelling: rope_parameters carrying rope_theta and rope_type
    v5 = dict(PUBLISHED["deepseek-v2"])
    scaling = dict(v5.pop("rope_scaling"))
    scaling.pop("type")
    v5["rope_parameters"] = dict(rope_type="yarn", rope_theta=v5.pop("rope_theta"), **scaling)
    assert MLAConfig.from_hf(v5) == MLAConfig.from_preset("deepseek-v2")


def test_softmax_scale_has_yarn_mscale_squared():
    cfg = MLAConfig.from_preset("deepseek-v3")
    mscale = 0.1 * 1.0 * __import__("math").log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    plain = cfg.replace(rope_scaling=None)
    assert plain.softmax_scale == pytest.approx(192**-0.5, rel=1e-12)


@pytest.mark.parametrize("changes,match", [
    (dict(qk_rope_head_dim=7), "even"),
    (dict(num_heads=0), "num_heads"),
    (dict(kv_lora_rank=-1), "kv_lora_rank"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(hidden_size=3.5), "hidden_size"),
    (dict(rope_scaling=dict(factor=4.0)), "missing"),
    (dict(rope_scaling=dict(factor=0.5, original_max_position_embeddings=64)), "factor"),
    (dict(rope_scaling=dict(factor=2.0, original_max_position_embeddings=64)), "inconsistent"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=512)), "original"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64, gamma=1)), "unknown"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64, beta_fast=1,
                            beta_slow=32)), "beta_fast"),
    (dict(q_lora_rank=True), "q_lora_rank"),
    (dict(q_lora_rank=24.0), "q_lora_rank"),
    (dict(num_heads=True), "num_heads"),
    (dict(max_position_embeddings=False), "max_position_embeddings"),
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(rope_theta=1.0), "rope_theta"),
    (dict(rope_theta=True), "rope_theta"),
    (dict(rope_theta="10000"), "rope_theta"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (dict(attention_bias=1), "attention_bias"),
    (dict(rope_scaling=dict(factor=True, original_max_position_embeddings=64)),
     r"rope_scaling\['factor'\] must be a finite number"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64.0)), "original"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64,
                            mscale=float("nan"))), "mscale"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64,
                            mscale_all_dim=-1.0)), "mscale_all_dim"),
    (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64,
                            beta_fast=float("inf"))), "beta_fast"),
])
def test_validation_names_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig.from_preset("tiny").replace(**changes)


def test_numpy_integers_and_whole_floats_are_read_as_numbers():
    np = pytest.importorskip("numpy")
    cfg = MLAConfig.from_preset("tiny")
    same = cfg.replace(num_heads=np.int64(4), q_lora_rank=np.int32(24), rope_theta=np.float32(1e4))
    assert same == cfg and type(same.num_heads) is int and type(same.rope_theta) is float
    assert cfg.replace(rope_theta=10000).rope_theta == 10000.0


def test_unknown_preset_and_rope_type():
    with pytest.raises(ValueError, match="unknown preset 'deepseek-v4'"):
        MLAConfig.from_preset("deepseek-v4")
    bad = dict(PUBLISHED["deepseek-v3"], rope_scaling=dict(type="linear", factor=2.0))
    with pytest.raises(ValueError, match="linear"):
        MLAConfig.from_hf(bad)


def test_to_hf_dict_round_trips():
    for name in mla.PRESETS:
        cfg = MLAConfig.from_preset(name)
        assert MLAConfig.from_hf(cfg.to_hf_dict()) == cfg
