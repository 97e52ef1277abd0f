"""Runtime tests: the tiny-model fixtures of the exporter tests."""

from tests.exporter.tiny_models import tiny_export, tiny_model  # noqa: F401
