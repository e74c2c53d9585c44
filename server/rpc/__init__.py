"""The gRPC layer of a worker and the only part of the server that imports gRPC: the server, the servicer and its thread pools."""
