"""Layer placement: node descriptions, the cost model and the dynamic-programming planner.

Plain domain code over core only (no OpenVINO, no exporter), so the planner is cheap to import,
to test against brute force and to run on a laptop for a fleet elsewhere. ``profile`` (measuring
this machine) and ``cli`` sit one layer above it (docs/ARCHITECTURE.md).
"""
