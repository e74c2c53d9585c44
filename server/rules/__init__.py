"""What a worker checks and concludes from a bucket before touching memory: spec and size validation, which payload is its own, layouts and tensor views."""
