"""The OpenAI-compatible gateway in front of a pipeline of stages."""
