"""Generated protobuf and gRPC modules for package pipeshard.v1 (run `make proto`)."""
