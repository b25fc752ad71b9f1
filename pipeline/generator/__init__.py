"""The vLLM generator: engine driver (engine.py), requests/seeds (requests.py), worker extension."""
