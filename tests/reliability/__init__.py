"""Reliability tests (a package, so its conftest does not shadow other folders' ``conftest`` module)."""
