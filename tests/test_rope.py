"""RoPE and YaRN against independent formulas (plain Python math, float64)."""

import math

import pytest
import torch

from mla import MLAConfig
from mla.rope import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq


def yarn_theta_reference(dim, base, factor, original, beta_fast, beta_slow):
    """YaRN's per-pair frequency, from the paper's definitions (arXiv:2309.00071, section 3.2)."""
    def pair_of(rotations):  # the pair whose wavelength fits `rotations` times in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(pair_of(beta_fast)), 0)
    high = min(math.ceil(pair_of(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / ((high - low) or 0.001), 0.0), 1.0)  # 0 fast, 1 slow
        out.append(theta / factor * ramp + theta * (1 - ramp))
    return out


def rotate_pairs_reference(x, positions, thetas, scale):
    """Pair (x[2i], x[2i+1]) times the 2x2 rotation by m·θ_i, then the attention factor."""
    out = torch.empty_like(x)
    for m_idx, m in enumerate(positions):
        for i, theta in enumerate(thetas):
            a = m * theta
            c, s = math.cos(a) * scale, math.sin(a) * scale
            x0, x1 = x[m_idx, 2 * i].item(), x[m_idx, 2 * i + 1].item()
            out[m_idx, 2 * i] = x0 * c - x1 * s
            out[m_idx, 2 * i + 1] = x1 * c + x0 * s
    return out


def _tiny_with_mscales(mscale, mscale_all_dim):
    return MLAConfig.from_preset("tiny").replace(rope_scaling=dict(
        factor=4.0, original_max_position_embeddings=64, mscale=mscale,
        mscale_all_dim=mscale_all_dim))


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3", "deepseek-v2", "mscales-differ"])
def test_inv_freq_and_rotation_match_independent_formula(preset):
    # every published config has mscale == mscale_all_dim, where their ratio is 1 either way up
    cfg = (_tiny_with_mscales(1.0, 0.5) if preset == "mscales-differ"
           else MLAConfig.from_preset(preset))
    y = cfg.yarn
    thetas = yarn_theta_reference(cfg.qk_rope_head_dim, cfg.rope_theta, y["factor"],
                                  y["original_max_position_embeddings"], y["beta_fast"],
                                  y["beta_slow"])
    assert torch.allclose(rope_inv_freq(cfg).double(), torch.tensor(thetas, dtype=torch.float64),
                          rtol=1e-6, atol=0)
    mscale = lambda m: 0.1 * m * math.log(y["factor"]) + 1  # noqa: E731
    assert rope_attention_factor(cfg) == pytest.approx(mscale(y["mscale"]) / mscale(y["mscale_all_dim"]))

    positions = [0, 1, 7, 63, 64, 200, 4095, 20000]
    x = torch.randn(len(positions), cfg.qk_rope_head_dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(cfg, torch.tensor(positions), torch.float64)
    got = apply_rope(x, cos, sin)
    ref = rotate_pairs_reference(x, positions, thetas, rope_attention_factor(cfg))
    # angles are float32 (as in the checkpoints' code): m·θ carries ~m·6e-8 rad of error
    tol = 6e-8 * max(positions) * 4 + 1e-6
    assert torch.allclose(got, ref, atol=tol * x.abs().max().item(), rtol=0)


def test_no_yarn_is_plain_rope_and_pairs_are_neighbours():
    cfg = MLAConfig.from_preset("tiny").replace(rope_scaling=None)
    r = cfg.qk_rope_head_dim
    assert torch.allclose(rope_inv_freq(cfg).double(),
                          torch.tensor([10000 ** (-2 * i / r) for i in range(r // 2)],
                                       dtype=torch.float64), rtol=1e-6)
    # only pair 0 non-zero in, only dims 0 and 1 non-zero out (interleaved, not rotate_half)
    x = torch.zeros(1, r, dtype=torch.float64)
    x[0, 0] = 1.0
    cos, sin = rope_cos_sin(cfg, torch.tensor([3]), torch.float64)
    out = apply_rope(x, cos, sin)
    assert torch.count_nonzero(out[0, 2:]) == 0
    assert out[0, 1].item() == pytest.approx(math.sin(3.0), rel=1e-6)


def test_scores_depend_on_relative_position_only():
    cfg = MLAConfig.from_preset("tiny")
    q, k = torch.randn(2, cfg.qk_rope_head_dim, dtype=torch.float64)
    def score(m, n):
        cq, sq = rope_cos_sin(cfg, torch.tensor([m]), torch.float64)
        ck, sk = rope_cos_sin(cfg, torch.tensor([n]), torch.float64)
        return (apply_rope(q[None], cq, sq) * apply_rope(k[None], ck, sk)).sum().item()
    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-5)


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 0.707), (0.707, 1.0), (1.0, 0.0),
                                                   (0.0, 1.0)])
def test_cos_sin_and_softmax_scale_match_transformers(mscale, mscale_all_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = _tiny_with_mscales(mscale, mscale_all_dim)
    fields = dict(cfg.to_hf_dict(), vocab_size=8, num_hidden_layers=1,
                  num_key_value_heads=cfg.num_heads)
    hf_cfg = transformers.DeepseekV3Config(**fields)
    hf_rope = hf.DeepseekV3RotaryEmbedding(hf_cfg)
    assert hf_rope.rope_type == "yarn"
    positions = torch.tensor([[0, 1, 5, 63, 64, 200, 255]])
    # HF's cos, sin: (1, s, r) = [cos(m·θ) | cos(m·θ)] times its attention factor, float32
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float64), positions)
    cos, sin = rope_cos_sin(cfg, positions[0], torch.float64)  # (s, r/2)
    half = cfg.qk_rope_head_dim // 2
    assert torch.allclose(cos, hf_cos[0, :, :half], rtol=1e-6, atol=1e-7)
    assert torch.allclose(sin, hf_sin[0, :, :half], rtol=1e-6, atol=1e-7)
    assert rope_attention_factor(cfg) == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    hf_attn = hf.DeepseekV3Attention(hf_cfg, layer_idx=0)
    assert cfg.softmax_scale == pytest.approx(hf_attn.scaling, rel=1e-12)


def test_rope_tables_are_built_once_per_setting_and_device(monkeypatch):
    """rope_cos_sin builds θ_i once for each RoPE setting (and device), not at every call."""
    import mla.rope as rope

    built = []
    real = rope.rope_inv_freq
    monkeypatch.setattr(rope, "rope_inv_freq", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(rope, "_TABLES", {})
    v3 = MLAConfig.from_preset("deepseek-v3")
    first = rope_cos_sin(v3, torch.arange(5), torch.float32)
    again = rope_cos_sin(v3.replace(name="other", num_heads=8), torch.arange(5), torch.float32)
    assert len(built) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    rope_cos_sin(v3.replace(rope_theta=20000.0), torch.arange(5), torch.float32)
    rope_cos_sin(MLAConfig.from_preset("tiny"), torch.arange(5), torch.float32)
    assert len(built) == 3



def test_rope_tables_and_fake_tensors(monkeypatch):
    """Positions of a tracer (torch's FakeTensorMode, as torch.export uses) get a table in its
    mode, before and after a real call has kept one; the kept table stays a real one."""
    import mla.rope as rope
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(rope, "_TABLES", {})
    cfg = MLAConfig.from_preset("tiny")
    for real_first in (False, True):
        if real_first:
            expected = rope_cos_sin(cfg, torch.arange(4), torch.float32)
        with FakeTensorMode() as mode:
            cos, sin = rope_cos_sin(cfg, mode.from_tensor(torch.arange(4)), torch.float32)
            assert cos.shape == (4, cfg.qk_rope_head_dim // 2)
    assert all(type(t) is torch.Tensor for t, _ in rope._TABLES.values())
    assert all(torch.equal(a, b) for a, b in zip(rope_cos_sin(cfg, torch.arange(4), torch.float32),
                                                 expected))
