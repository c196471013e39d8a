"""mla.memory: cache sizes against the paper's table, and arguments checked by name."""

import pytest

from mla import MLAConfig, memory


def test_cache_elements_follow_the_papers_table():
    v2 = MLAConfig.from_preset("deepseek-v2")  # h 128, d_h 128, c 512, r 64
    assert memory.cache_elements_per_token(v2, "mha") == 2 * 128 * 128
    assert memory.cache_elements_per_token(v2, "gqa-8") == 2 * 8 * 128
    assert memory.cache_elements_per_token(v2, "mqa") == 2 * 128
    assert memory.cache_elements_per_token(v2, "mla") == 512 + 64 == 9 / 2 * 128
    rows = memory.kv_cache_table(v2, seq_len=1000, num_layers=60)
    mla_row = next(r for r in rows if r["scheme"] == "mla")
    assert mla_row["bytes_per_sequence"] == 576 * 60 * 2.0 * 1000
    assert memory.kv_cache_table(v2, seq_len=0, num_layers=1)[0]["bytes_per_sequence"] == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=-5, num_layers=60), "seq_len must be an int >= 0, got -5"),
    (dict(seq_len=4096, num_layers=-1), "num_layers must be an int >= 1, got -1"),
    (dict(seq_len=4096, num_layers=0), "num_layers"),
    (dict(seq_len=1.5, num_layers=60), "seq_len"),
    (dict(seq_len=True, num_layers=60), "seq_len"),
    (dict(seq_len=4096, num_layers=60, bytes_per_element=-2.0), "bytes_per_element"),
    (dict(seq_len=4096, num_layers=60, schemes=("gqa-x",)), "gqa-x"),
])
def test_kv_cache_table_names_a_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory.kv_cache_table(MLAConfig.from_preset("deepseek-v2"), **kwargs)


def test_flop_counts_name_a_bad_argument():
    cfg = MLAConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="s=0"):
        memory.attention_flops(cfg, 0, 4)
    with pytest.raises(ValueError, match="s=2.5"):
        memory.attention_flops(cfg, 2.5, 4)
    with pytest.raises(ValueError, match="context must be an int >= 0, got -1"):
        memory.prefill_crossover(cfg, -1)
    with pytest.raises(ValueError, match="bits_per_element"):
        memory.paper_kv_reduction_vs_67b(0)


def test_latent_cache_bytes_per_cache_dtype():
    """DeepSeek-V3's latent cache a token a layer: 1152 bytes in bf16, 576 in fp8_e4m3, 656 in
    fp8_ds_mla (512 e4m3 values, 4 float32 scales, 64 bf16 rope values)."""
    v3 = MLAConfig.from_preset("deepseek-v3")
    assert memory.latent_cache_bytes_per_token(v3) == 1152
    assert memory.latent_cache_bytes_per_token(v3, "auto", bytes_per_element=4) == 2304
    assert memory.latent_cache_bytes_per_token(v3, "fp8_e4m3") == 576
    assert memory.latent_cache_bytes_per_token(v3, "fp8") == 576
    assert memory.latent_cache_bytes_per_token(v3, "fp8_ds_mla") == 512 + 4 * 4 + 2 * 64 == 656
    rows = {r["scheme"]: r for r in memory.kv_cache_table(v3, seq_len=10, num_layers=61)}
    assert rows["mla"]["bytes_per_token"] == 1152 * 61
    assert rows["mla-fp8_e4m3"]["bytes_per_token"] == 576 * 61
    assert rows["mla-fp8_ds_mla"]["bytes_per_sequence"] == 656 * 61 * 10
    assert rows["mla-fp8_ds_mla"]["elements_per_token_layer"] == 576
    # the fp8 layouts fix their bytes: a float32 table changes only the other rows
    rows32 = {r["scheme"]: r for r in memory.kv_cache_table(v3, 10, 61, bytes_per_element=4.0)}
    assert rows32["mla"]["bytes_per_token"] == 2304 * 61
    assert rows32["mla-fp8_ds_mla"]["bytes_per_token"] == 656 * 61
    with pytest.raises(ValueError, match="kv_cache_dtype must be .*got 'int4'"):
        memory.latent_cache_bytes_per_token(v3, "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        memory.latent_cache_bytes_per_token(MLAConfig.from_preset("tiny"), "fp8_ds_mla")
