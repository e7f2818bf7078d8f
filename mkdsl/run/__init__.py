"""Running a spec on the host: the unfused reference (the oracle), random weights for tests, the XLA
prefill (one device or per device), sampling, `mkdsl run`'s decoder and kernel cache, and `mkdsl bench`."""
