"""One update's lifecycle on the trainer: planning, jobs, staging, each worker's stream, the session that commits, blame, and the public types."""
