"""The colocated replica process (`llm.colocate`): an encoder and an LLM engine in one replica, on one GPU."""
