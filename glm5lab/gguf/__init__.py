"""GGUF tools for GLM-5 (llama.cpp architecture `glm-dsa`): write, inspect, split, merge (notebook 01).
Needs only the `gguf` package: no vLLM here."""
