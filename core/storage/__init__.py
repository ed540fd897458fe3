"""On-disk formats and their safety: atomic writes, stage locks, manifests, hidden shards (fp8 rows), conversations, trained-prompt digests."""
