"""A worker's core without gRPC: the engine adapter interface, the service (identity, version, state), one update in progress and the requests of its stream."""
