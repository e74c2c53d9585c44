"""What a trainer can observe about its pushes: optional Prometheus metrics."""
