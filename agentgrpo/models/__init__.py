"""Models: loading the policy and reference, the default model, the warm start, sharded weights."""
