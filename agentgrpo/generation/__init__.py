"""Generation: which backend generates, how the policy's weights reach it, the vLLM server."""
