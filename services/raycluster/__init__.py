"""A fleet that assembles itself on a Ray cluster (``pipeshard up --ray``, docs/RAY.md).

Ray gives the membership, each node's resources, placement groups, actor restarts and the
dashboard; this package only maps a pipeshard fleet onto them: one actor per service process.
"""
