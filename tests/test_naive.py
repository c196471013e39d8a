"""The naive tier against transformers' DeepseekV2Attention / DeepseekV3Attention (outside
references), and its causal mask against a per-prefix loop (no outside dependency).

HF is built offline from a small config with random weights; both sides share one state dict.
HF computes the full sequence in one causal pass; we feed the same tokens through prefill,
chunked prefill and decode, which must give the same outputs at every position.
"""

import pytest
import torch

import mla
from mla.naive import NaiveMLA

from assertions import assert_rel_close

SMALL = dict(hidden_size=48, num_heads=3, kv_lora_rank=20, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, rope_theta=10000.0, rms_norm_eps=1e-6)
YARN = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=0.707)
YARN_V3 = dict(YARN, mscale=1.0, mscale_all_dim=1.0)


def hf_attention(cfg: mla.MLAConfig, version: int):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    fields = cfg.to_hf_dict()
    fields.update(vocab_size=32, num_hidden_layers=1, intermediate_size=32,
                  moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                  num_key_value_heads=cfg.num_heads)
    module = hf_v3 if version == 3 else hf_v2
    config_cls = (transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config)
    hf_cfg = config_cls(**fields)
    hf_cfg._attn_implementation = "eager"
    attn_cls = module.DeepseekV3Attention if version == 3 else module.DeepseekV2Attention
    rope_cls = module.DeepseekV3RotaryEmbedding if version == 3 else module.DeepseekV2RotaryEmbedding
    return attn_cls(hf_cfg, layer_idx=0).double(), rope_cls(hf_cfg), hf_cfg


def hf_forward(attn, rope, x: torch.Tensor) -> torch.Tensor:
    """HF's causal attention over whole rows x (b, s, hidden), float64."""
    b, s, _ = x.shape
    positions = torch.arange(s)[None].expand(b, s)
    mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)[None, None].expand(b, 1, s, s)
    emb = rope(x, positions)
    out, _ = attn(x, position_embeddings=emb, attention_mask=mask)
    return out


CASES = [
    pytest.param(3, 16, None, id="v3-qlora"),
    pytest.param(3, None, None, id="v3-noqlora"),
    pytest.param(3, 16, YARN_V3, id="v3-qlora-yarn"),
    pytest.param(3, None, YARN, id="v3-noqlora-yarn"),
    pytest.param(2, 16, None, id="v2-qlora"),
    pytest.param(2, None, None, id="v2-noqlora"),
    pytest.param(2, None, YARN, id="v2-noqlora-yarn"),
    pytest.param(2, 16, YARN, id="v2-qlora-yarn"),
]


@pytest.mark.parametrize("version,q_lora_rank,yarn", CASES)
def test_naive_matches_transformers(version, q_lora_rank, yarn):
    b, s = 2, 40
    if yarn is not None:
        # YaRN stretches the original 16 positions by its factor (4) to 64; the 40 tokens run
        # past the original context, where YaRN's interpolated frequencies take over.
        original = yarn["original_max_position_embeddings"]
        max_pos = int(yarn["factor"] * original)
        assert original < s <= max_pos
    else:
        max_pos = s  # plain RoPE: the model is made for exactly the positions used
    cfg = mla.MLAConfig(q_lora_rank=q_lora_rank, rope_scaling=yarn,
                        max_position_embeddings=max_pos, **SMALL)
    hf_attn, hf_rope, _ = hf_attention(cfg, version)
    assert hf_rope.rope_type == ("default" if yarn is None else "yarn")  # HF took our scaling
    weights = mla.MLAWeights(cfg, dtype=torch.float64, seed=1)
    weights.load_state_dict(hf_attn.state_dict())  # HF names load as they are
    hf_attn.load_state_dict(weights.state_dict())
    naive = NaiveMLA(weights)

    x = torch.randn(b, s, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ref = hf_forward(hf_attn, hf_rope, x)
        # one prefill
        cache = naive.new_cache(b, s)
        assert_rel_close(naive(x, cache), ref, 1e-6)
        # chunked prefill (13 + 15) then 12 decode steps
        cache = naive.new_cache(b, s)
        pieces = [naive(x[:, :13], cache), naive(x[:, 13:28], cache)]
        pieces += [naive(x[:, j:j + 1], cache) for j in range(28, s)]
        assert_rel_close(torch.cat(pieces, dim=1), ref, 1e-6)
        assert cache.seq_lens.tolist() == [s, s]


def test_naive_ragged_batch_matches_transformers_per_row():
    cfg = mla.MLAConfig(q_lora_rank=16, rope_scaling=YARN_V3, max_position_embeddings=64, **SMALL)
    hf_attn, hf_rope, _ = hf_attention(cfg, 3)
    weights = mla.MLAWeights(cfg, dtype=torch.float64, seed=2)
    hf_attn.load_state_dict(weights.state_dict())
    naive = NaiveMLA(weights)
    full = [20, 9, 33]
    xs = [torch.randn(1, n, cfg.hidden_size, dtype=torch.float64) for n in full]
    with torch.no_grad():
        refs = [hf_forward(hf_attn, hf_rope, x)[0] for x in xs]
        cache = naive.new_cache(3, 40)
        # prefill lengths 12, 0 (row 1 sits out), 20
        first = [12, 0, 20]
        x = torch.zeros(3, 20, cfg.hidden_size, dtype=torch.float64)
        for i, n in enumerate(first):
            x[i, :n] = xs[i][0, :n]
        y = naive(x, cache, torch.tensor(first))
        for i, n in enumerate(first):
            assert_rel_close(y[i, :n], refs[i][:n], 1e-6)
            assert torch.all(y[i, n:] == 0)  # padded positions are zeros
        # then everything that is left, ragged again
        rest = [f - n for f, n in zip(full, first)]
        s = max(rest)
        x = torch.zeros(3, s, cfg.hidden_size, dtype=torch.float64)
        for i, n in enumerate(rest):
            x[i, :n] = xs[i][0, first[i]:]
        y = naive(x, cache, torch.tensor(rest))
        for i, n in enumerate(rest):
            assert_rel_close(y[i, :n], refs[i][first[i]:], 1e-6)
            assert torch.all(y[i, n:] == 0)
        assert cache.seq_lens.tolist() == full


def test_prefill_and_extend_see_exactly_the_past():
    """Query position p attends to cached positions 0..p, no more, no fewer: a ragged prefill
    and an extend over it against the last output of a fresh call on each prefix x[:p+1]."""
    cfg = mla.MLAConfig.from_preset("tiny")
    naive = NaiveMLA(mla.MLAWeights(cfg, dtype=torch.float64, seed=4))
    full, first = [12, 7], [5, 0]
    x = torch.randn(2, 12, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        cache = naive.new_cache(2, 12)
        y_first = naive(x[:, :5], cache, first)
        rest = torch.zeros_like(x[:, :7])
        for i, (f, n) in enumerate(zip(full, first)):
            rest[i, :f - n] = x[i, n:f]
        y_rest = naive(rest, cache, [f - n for f, n in zip(full, first)])
        for i, (f, n) in enumerate(zip(full, first)):
            ref = torch.cat([naive(x[i:i + 1, :p + 1], naive.new_cache(1, 12))[0, -1:]
                             for p in range(f)])  # (f, hidden)
            assert_rel_close(y_first[i, :n], ref[:n], 1e-6)
            assert_rel_close(y_rest[i, :f - n], ref[n:], 1e-6)
