"""The engine loop: the `Worker`, each job's life in the engine, and what one step needs."""
