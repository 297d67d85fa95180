"""The fused statistics path in Triton: see :mod:`tensorlens.stats.triton.rows`."""
