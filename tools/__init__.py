"""Tools around the decoder runtime: benchmarks, converters, the CUDA build check.
Never copied into the submission image; they use decoder/'s public API only."""
