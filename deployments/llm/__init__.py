"""The LLM replica process: the generating engines (transformers or vLLM) that the router hands embeddings to."""
