"""What two or more stages share: config schema, target loading, on-disk formats, drafter, decode engine."""
