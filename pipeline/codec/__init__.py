"""Compiled pieces of the patch codec (numba, GIL released): the chunk diff and scatter kernels and
the rANS entropy coder. The format itself lives in pipeline.patch_codec."""
