"""Exporter tests: tiny-model fixtures (see tiny_models.py)."""

from tests.exporter.tiny_models import tiny_export, tiny_model  # noqa: F401
