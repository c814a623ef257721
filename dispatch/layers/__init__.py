"""The MLA layer around anymla's attention kernels (DeepSeek V3 / V3.2): prolog, absorbed attention, epilogue.

:class:`MLAAttention` takes hidden states and positions, writes the step's latent rows into a paged cache of
any format and returns the layer's output (o_proj applied, residual optional); :func:`from_hf` builds it from
a Hugging Face ``DeepseekV3Attention`` / ``DeepseekV32Attention`` module; :class:`V4Attention` is DeepSeek V4's
sliding-window attention (:func:`from_hf_v4`). :func:`write_cache` is the public
quantize-on-write cache writer for every format, :func:`sparse_slots` turns DSA indices into cache slots.
"""

from .attention import MLAAttention
from .cache_write import explain_write_cache, write_cache, write_cache_reference
from .config import MLAConfig
from .eager import mla_forward_eager
from .hf import config_from_hf, config_from_hf_v4, from_hf, from_hf_v4
from .prolog import assemble_q, assemble_q_reference, mla_prolog, mla_prolog_reference, rms_norm
from .rope import RopeTable, apply_rope, rope_frequencies
from .slots import sparse_slots, sparse_slots_reference
from .v4 import V4Attention, V4Config

__all__ = ["MLAAttention", "MLAConfig", "from_hf", "config_from_hf", "write_cache", "write_cache_reference",
           "explain_write_cache", "mla_prolog", "mla_prolog_reference", "assemble_q", "assemble_q_reference",
           "rms_norm", "RopeTable", "apply_rope", "rope_frequencies", "mla_forward_eager", "sparse_slots",
           "sparse_slots_reference", "V4Attention", "V4Config", "from_hf_v4", "config_from_hf_v4"]
