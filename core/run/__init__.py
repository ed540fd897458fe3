"""The run's configuration: the typed config, stage CLIs, errors, plans, the SIGTERM stop."""
