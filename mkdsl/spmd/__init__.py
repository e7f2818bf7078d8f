"""The shard passes: the whole model becomes what one device runs (shard), with its collectives
ordered (ready), fused with the norms they feed (defer_norm) and overlapped with independent work
(overlap)."""
