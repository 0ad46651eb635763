"""The training engine: step loop, telemetry, checkpoints and optimisation."""
