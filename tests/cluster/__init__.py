"""Tests of the worker on a Ray cluster (a package, so its conftest does not shadow other folders' ``conftest``)."""
