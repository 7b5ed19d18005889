"""clustertrain: one config, one CLI, from a laptop CPU to hundreds of Slurm nodes."""

__version__ = "0.1.0"
