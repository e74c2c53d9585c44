"""What a worker tells the outside world: Prometheus metrics, update events and one log line per update."""
