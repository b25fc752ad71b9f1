"""The vLLM generator: configuration and requests (config.py), the driver (engine.py), the worker extension."""
