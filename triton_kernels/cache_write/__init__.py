"""Quantize-on-write into a paged MLA cache (every anymla format) and the fused MLA prolog kernels."""
