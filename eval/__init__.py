"""Stage 4: drafter + target -> acceptance length, throughput vs the plain target, report."""
