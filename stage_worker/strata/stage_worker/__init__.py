"""A pipeline stage: a torch slice of a model's layers served over gRPC."""
