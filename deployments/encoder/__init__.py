"""The encoder replica process: `EncoderReplica`, which runs the vision tower's graphs, and its compile-cache tool."""
