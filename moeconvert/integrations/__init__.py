"""Integrations with serving engines (each imported only by the engine that loads it)."""
