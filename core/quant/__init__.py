"""Number formats: MXFP4, NVFP4 and FP8 codecs."""
