"""The vector cores' row decoders (DecodeFp8Row / DecodeFp4Row, modelled step by step with the table the host
binding's DecodeTables uploads) against anymla.kvcache.gather_rows, bit for bit."""

import numpy as np
import pytest
import torch

from anymla.ascendc_kernels.sparse_attention_v41.layout_model import dequant
from anymla.ascendc_kernels.sparse_attention_v41.layout_model.headers import kernel_headers
from anymla.ascendc_kernels.sparse_attention_v41.layout_model.memory import bf16_to_f32
from anymla.kvcache import KVCacheFormat, gather_rows, quantize

TABLE = dequant.decode_table(kernel_headers())
FORMATS = {KVCacheFormat.V41_FP8: 528, KVCacheFormat.V41_FP4: 288}


def _decode(fmt, rows: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        if fmt is KVCacheFormat.V41_FP8:
            return np.stack([dequant.decode_fp8_row(r) for r in rows])
        return np.stack([dequant.decode_fp4_row(r, TABLE) for r in rows])


def _assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    got_nan, want_nan = np.isnan(bf16_to_f32(got)), np.isnan(bf16_to_f32(want))
    assert np.array_equal(got_nan, want_nan)
    assert np.array_equal(got[~got_nan], want[~want_nan])  # bits, so -0.0 and subnormals count


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f.name)
def test_decoders_match_gather_rows_on_quantized_caches(fmt):
    gen = torch.Generator().manual_seed(5)
    scale = torch.logspace(-6, 6, 8)[torch.randint(0, 8, (6, 7, 1, 1), generator=gen)]
    kv = (torch.randn(6, 7, 1, 512, generator=gen) * scale).to(torch.bfloat16)
    cache = quantize(kv, fmt)
    want = gather_rows(cache, torch.arange(42), fmt).view(torch.int16).numpy().view(np.uint16)
    _assert_bit_exact(_decode(fmt, cache.view(42, -1).numpy()), want)


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f.name)
def test_decoders_match_gather_rows_on_every_byte_code(fmt):
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (256, FORMATS[fmt]), dtype=np.uint8)
    raw[:, 0] = np.arange(256)  # every data code
    raw[:, FORMATS[fmt] - 1] = np.arange(256)[::-1]  # every scale code
    cache = torch.from_numpy(raw).view(16, 16, 1, FORMATS[fmt])
    want = gather_rows(cache, torch.arange(256), fmt).view(torch.int16).numpy().view(np.uint16)
    _assert_bit_exact(_decode(fmt, raw), want)


def test_decode_table_is_read_from_the_binding_and_refuses_a_changed_one():
    assert TABLE.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(TABLE[8])
    with pytest.raises(ValueError, match="DecodeTables"):
        dequant.decode_table(kernel_headers(), "at::Tensor DecodeTables(const at::Device& d) { return {}; }")
