"""Exporter: turns a Hugging Face model folder into N per-stage OpenVINO shards plus a manifest."""

EXPORTER_VERSION = "0.1.0"
